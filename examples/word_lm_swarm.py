"""Word-level language model: pytorch/examples' word_language_model, small, in one process (word_lm_plain.py)
and its swarm port (word_lm_swarm.py: `diff examples/word_lm_plain.py examples/word_lm_swarm.py`).

As the original: an LSTM language model, SGD at lr 20, gradients clipped to 0.25, one epoch over the training
text, validation perplexity at the end, and the lr divided by 4 when the validation loss stops improving (here
evaluated every EVAL_EVERY steps on a fixed validation set, rather than once per epoch: one epoch would never
anneal). Small enough for a CPU in a minute: a generated corpus (a Markov "language" of 50 words, the same on
every machine), one LSTM layer of 64 units (the original's --nlayers 1).

One change from the original loop, made here too so that both scripts train alike: each batch of BPTT-token
windows starts from a zero hidden state (the original carries it across batches, in text order). A swarm
takes blocks of examples in a shuffled order, so a model carrying state across batches is out of scope.

    python examples/word_lm_plain.py --seed 0                            # one process
    SWARMRUN_STATE_DIR=/tmp/a python examples/word_lm_swarm.py           # the swarm: creates run "word-lm"
    SWARMRUN_STATE_DIR=/tmp/b python examples/word_lm_swarm.py --peers /ip4/127.0.0.1/tcp/.../p2p/Qm...

Each prints one JSON line: {"val_loss", "val_ppl"}.
"""

import argparse
import json
import math
import random
import sys

import torch
from torch import nn
import swarmrun

BPTT, BATCH, LR, CLIP, EPOCHS, EVAL_EVERY = 35, 20, 20.0, 0.25, 1, 10


# --- data: a generated corpus, tokenized as the original's data.Corpus does ----------------------------------
def make_text(rng: random.Random, lines: int, successors: list) -> str:
    """Lines of words; each word is followed by one of its 4 successors (weights 8:4:2:1), or rarely any word."""
    out = []
    for _ in range(lines):
        word, line = int(rng.random() * len(successors)), []
        for _ in range(5 + int(rng.random() * 15)):
            r = rng.random()
            nxt = successors[word][0 if r < 8 / 15 else 1 if r < 12 / 15 else 2 if r < 14 / 15 else 3]
            word = int(rng.random() * len(successors)) if rng.random() < 0.05 else nxt
            line.append(f"w{word}")
        out.append(" ".join(line))
    return "\n".join(out)


class Dictionary:
    def __init__(self):
        self.word2idx, self.idx2word = {}, []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)

    def tokenize(self, text: str) -> torch.Tensor:
        return torch.tensor([self.add_word(w) for line in text.splitlines() for w in line.split() + ["<eos>"]])


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of BPTT tokens (inputs) and the tokens that follow each (targets), batch first."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return (len(self.ids) - 1) // BPTT

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.ids[i * BPTT:(i + 1) * BPTT], self.ids[i * BPTT + 1:(i + 1) * BPTT + 1]


_rng = random.Random(1234)
_successors = [[int(_rng.random() * 50) for _ in range(4)] for _ in range(50)]
dictionary = Dictionary()
train_data = Windows(dictionary.tokenize(make_text(_rng, 1700, _successors)))  # 600 windows: 30 steps of BATCH
valid_data = Windows(dictionary.tokenize(make_text(_rng, 200, _successors)))
valid_batch = torch.utils.data.default_collate([valid_data[i] for i in range(len(valid_data))])


# --- the model, the loss, the evaluation -----------------------------------------------------------------------
class RNNModel(nn.Module):
    """Embedding, LSTM, linear decoder; dropout on both sides of the LSTM (the original's RNNModel, batch first)."""

    def __init__(self, ntoken: int, ninp: int = 64, nhid: int = 64, nlayers: int = 1, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.drop(self.encoder(x)))  # the hidden state starts at zeros for every batch
        return self.decoder(self.drop(output))


def make_model() -> nn.Module:
    return RNNModel(len(dictionary))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, len(dictionary)), y.reshape(-1))


def evaluate(model: nn.Module) -> float:
    """Mean loss per token on the validation windows (a fixed set: the same value for the same weights)."""
    model.eval()
    with torch.no_grad():
        loss = loss_fn(model, valid_batch).item()
    model.train()
    return loss


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def make_schedule(optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    """lr / 4 when the validation loss did not improve since the last evaluation (the original's annealing)."""
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.25, patience=0, threshold=0)


# --- training ----------------------------------------------------------------------------------------------------
def train(args) -> nn.Module:
    task = swarmrun.make_task("word-lm", model=make_model, dataset=train_data, loss=loss_fn, optimizer=make_optimizer,
                              scheduler=make_schedule, evaluate=evaluate, hparams=dict(epochs=EPOCHS, block_size=4,
                              target_batch_size=BATCH, clip_norm=CLIP, eval_every=EVAL_EVERY))
    return swarmrun.train(task, "word-lm", create=not args.peers, peers=args.peers, min_peers=args.min_peers,
                          batch_size=4, device="cpu", seed=args.seed, json=True, events=sys.stderr).model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", nargs="*", default=[], help="join the run at these multiaddrs (default: create it)")
    parser.add_argument("--min-peers", type=int, default=1, help="step once this many peers train")
    args = parser.parse_args()
    val_loss = evaluate(train(args))
    print(json.dumps({"val_loss": round(val_loss, 4), "val_ppl": round(math.exp(val_loss), 2)}))
