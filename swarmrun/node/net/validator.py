"""The run-record validator on hivemind: every record under a run's key passes ``protocol.records.check_record``.

hivemind calls a DHT's validators when another peer asks it to store a record (``DHTProtocol.rpc_store``), when
a peer answers its find (``DHTProtocol.call_find``: a refused record counts as not found) and before it stores
one of its own (``DHTNode.store_many``). A validator sees the *hashed* key (``DHTID`` bytes), so this one hashes
every key of the runs it watches (``protocol.records.run_keys``: a finite set per run) and maps the hashes back
to their schema; records under any other key it leaves to the other validators.

Where hivemind gives a validator no say, so this one cannot help (see issue 14): a find response that holds a
*dictionary* is validated entry by entry, but an empty one, or the dictionary's own expiration, is never shown to
a validator; a hostile DHT node can answer a find for a plain-value key (the spec, the pause) with an empty
dictionary and a far expiration and so hide the value from that reader. Keys with subkeys are not exposed to
this (dictionaries merge), and every key of a run has subkeys: the spec, the progress reports, the providers, the
votes, the pause notes and the amendment history under each writer's signed subkey, the revocations and the pause
under the owner's.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Optional, Union

from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.protocol.records import RUN_KEYS, check_record, run_keys

logger = logging.getLogger("swarmrun.records")

#: below ``RSASignatureValidator.priority`` (10): a CompositeValidator validates in decreasing priority and strips
#: each validator's signature before the next, so a signed record's signature is verified first and this
#: validator decodes the bare value (signing goes the other way, so this one signs nothing)
PRIORITY = 5


class RunRecordValidator(RecordValidatorBase):
    """Refuses a record under a watched run's key that breaks the run's schema table, on store and on read.

    One narrow subclass of hivemind's ``RecordValidatorBase``; overridden:
      - ``validate``: ``check_record`` on the record (never raises: a record that makes the check fail is refused);
      - ``priority``: ``PRIORITY``, so hivemind's signature check runs first (see there);
      - ``merge_with``: another ``RunRecordValidator`` adds its runs to this one, so ``DHT.add_validators`` (the
        only way into the DHT's process) watches more runs (``watch_runs``).
    ``sign_value``/``strip_value`` are the base's: this validator adds no signature of its own.

    Args:
        runs: run ids to watch, or a mapping run id -> the run owner's public key (None when not yet known); an
            owner key makes OWNER subkeys (the revocation list) acceptable only under that key.
        identify: ``public_key -> peer id`` (``swarm.peer_id_of``): a signed subkey must name its key's peer.
    """

    def __init__(self, runs: Union[Iterable[str], Mapping[str, Optional[bytes]]] = (), *,
                 identify: Optional[Callable[[bytes], str]] = None):
        self._keys: dict[int, tuple[str, str]] = {}  # hashed key (as an int) -> (kind, run id)
        self._owners: dict[str, Optional[bytes]] = {}
        self._identify = identify
        owners = runs if isinstance(runs, Mapping) else dict.fromkeys(runs)
        for run_id, owner_key in owners.items():
            self.watch(run_id, owner_key)

    def watch(self, run_id: str, owner_key: Optional[bytes] = None) -> None:
        """Validate the records of ``run_id`` from now on (in this process; in a running DHT: ``watch_runs``).

        Raises:
            ValueError: not a run id.
        """
        for key, schema in run_keys(run_id).items():
            self._keys[int(DHTID.generate(source=key))] = (schema.name, run_id)
        if owner_key is not None or run_id not in self._owners:
            self._owners[run_id] = owner_key

    @property
    def runs(self) -> frozenset[str]:
        return frozenset(self._owners)

    def validate(self, record: DHTRecord) -> bool:
        try:
            # by value: hivemind reads a key as an int, so b"\0" + key is the same key (a stranger's detour)
            found = self._keys.get(int.from_bytes(record.key, "big"))
            if found is None:
                return True
            kind, run_id = found
            rejection = check_record(RUN_KEYS[kind], record.subkey, record.value, record.expiration_time,
                                     get_dht_time(), run_id=run_id, owner_key=self._owners.get(run_id),
                                     identify=self._identify)
        except Exception as e:  # a bug in a check must not let a record through, nor kill hivemind's handler
            logger.warning(f"refused a record whose check failed: {type(e).__name__}: {e}")
            return False
        if rejection is not None:
            logger.debug(f"refused a record of run {run_id!r}: {rejection}")
            return False
        return True

    @property
    def priority(self) -> int:
        return PRIORITY

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RunRecordValidator):
            return False
        self._keys.update(other._keys)
        for run_id, owner_key in other._owners.items():
            if owner_key is not None or run_id not in self._owners:
                self._owners[run_id] = owner_key
        return True


def watch_runs(dht: DHT, runs: Union[Iterable[str], Mapping[str, Optional[bytes]]]) -> None:
    """Make a running DHT validate the records of more runs (or learn a run's owner key); its validator keeps the
    ``identify`` it was made with."""
    dht.add_validators([RunRecordValidator(runs)])
