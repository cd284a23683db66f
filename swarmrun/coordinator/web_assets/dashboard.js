// swarmrun dashboard: fetches the page's content (server-rendered HTML) every few seconds with the API
// token kept in localStorage, and calls the JSON API for actions. No framework, no external script.
(function () {
  "use strict";
  var KEY = "swarmrun.token";
  var live = document.getElementById("live");
  var status = document.getElementById("status");
  var url = live.dataset.fragment;
  var interval = Number(live.dataset.interval) || 2000;
  var last = null, busy = false;

  function token() { try { return localStorage.getItem(KEY) || ""; } catch (e) { return ""; } }
  function say(text) { if (status.textContent !== text) status.textContent = text; }
  function headers(extra) {
    var h = extra || {};
    if (token()) h.Authorization = "Bearer " + token();
    return h;
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      var r = await fetch(url, { headers: headers(), cache: "no-store" });
      if (r.status === 401) { say(token() ? "This token is not valid here: enter another." : "Enter your API token to see this page."); return; }
      if (!r.ok) { say("Could not refresh: HTTP " + r.status); return; }
      var html = await r.text();
      if (html !== last) {
        // Replace only on change, and give focus back to the control that had it (keyboard users).
        var focused = document.activeElement && live.contains(document.activeElement) ? document.activeElement.id : "";
        live.innerHTML = html;
        last = html;
        if (focused) { var el = document.getElementById(focused); if (el) el.focus(); }
      }
      live.dataset.updated = String(Date.now());
      if (status.textContent.indexOf("Could not") === 0 || status.textContent.indexOf("Enter") === 0 ||
          status.textContent.indexOf("This token") === 0) say("");
    } catch (e) {
      say("Could not refresh: " + e.message);
    } finally {
      busy = false;
    }
  }

  var form = document.getElementById("token-form");
  if (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      var input = document.getElementById("token");
      try { localStorage.setItem(KEY, input.value.trim()); } catch (e) { say("This browser keeps no token: " + e.message); }
      input.value = "";
      say("Token saved in this browser.");
      refresh();
    });
    document.getElementById("forget-token").addEventListener("click", function () {
      try { localStorage.removeItem(KEY); } catch (e) { /* nothing kept */ }
      say("Token forgotten.");
      last = null;
      refresh();
    });
  }

  async function act(button) {
    var run = encodeURIComponent(button.dataset.run), action = button.dataset.action;
    var method = "POST", path = "/api/runs/" + run + "/" + action, body;
    if (action === "priority") {
      method = "PATCH"; path = "/api/runs/" + run;
      body = JSON.stringify({ priority: Number(document.getElementById("priority").value) });
    }
    try {
      var r = await fetch(path, { method: method, headers: headers({ "Content-Type": "application/json" }), body: body });
      var j = await r.json().catch(function () { return {}; });
      say(r.ok ? action + ": run " + j.run.run_id + " is " + j.run.state + ", priority " + j.run.priority
               : action + " refused: " + (j.error || "HTTP " + r.status));
    } catch (e) {
      say(action + " failed: " + e.message);
    }
    refresh();
  }
  document.querySelectorAll("button[data-action]").forEach(function (b) {
    b.addEventListener("click", function () { act(b); });
  });

  refresh();
  setInterval(refresh, interval);
})();
