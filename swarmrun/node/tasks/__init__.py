"""The built-in tasks, installed under the entry-point group ``swarmrun.tasks``.

- ``synthetic`` (:class:`swarmrun.node.tasks.synthetic.SyntheticTask`): a tiny regression problem
  generated from the run's seed, with a 2-layer MLP; a step takes milliseconds. For tests and demos.
- ``char-lm`` (:class:`swarmrun.node.tasks.char_lm.CharLMTask`): a small GPT-style byte-level
  language model on a text corpus (by default the running Python's standard-library sources, or
  ``--set corpus=DIR``); trains visibly in minutes on a few CPU cores.

Both build their initial model and any generated data from dedicated ``torch.Generator`` streams,
never from torch's global RNG (see :mod:`swarmrun.node.tasks.seeded`).
"""
