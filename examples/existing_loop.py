"""Join a swarmrun run from an existing PyTorch script: your model, data and loss, a few lines more.

    python examples/existing_loop.py --create                      # first machine: creates run "example"
    python examples/existing_loop.py --peers /ip4/.../p2p/Qm...     # any other machine (or --state-dir DIR here)
"""

import argparse

import torch
from torch import nn

import swarmrun


# --- what an existing script already has ---------------------------------------------------------------
def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


g = torch.Generator().manual_seed(0)
X = torch.randn(2048, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.01 * torch.randn(2048, 1, generator=g)
dataset = torch.utils.data.TensorDataset(X, Y)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


# --- the swarmrun part -------------------------------------------------------------------------------------
task = swarmrun.make_task("example-mlp", model=make_model, dataset=dataset, loss=loss_fn,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
                          hparams={"total_steps": 40, "target_batch_size": 64, "eval_every": 10})

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--create", action="store_true")
    parser.add_argument("--peers", nargs="*", default=[])
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()
    result = swarmrun.train(task, "example", create=args.create, peers=args.peers, state_dir=args.state_dir,
                            device="cpu", max_steps=args.max_steps)
    print(f"left the run: {result.reason} at step {result.step}")  # result.model: the trained model
