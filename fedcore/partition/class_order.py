"""Which class name each class prompt is written with: the correct pairing, or FedOTP's official-code bug.

Read by training (the CLIP methods' prompts) and written by the partition (``bug_compat_classname_order``), so it
lies apart from the schemes: a run imports this, not the partition code.
"""
from __future__ import annotations

import numpy as np

CLASSNAME_STREAM = 0xC1A55  # rng stream of the class-name permutation, apart from the partition's own draw


def classname_order(num_classes: int, seed: int) -> np.ndarray:
    """bug_compat_classname_order: the fixed permutation whose k-th entry is the class whose name prompt k gets.

    The code's names come from a Python set, iterated in a hash-randomised order that changes per process; a
    permutation seeded by the partition seed (its own stream, so the partition's indices are unchanged) makes
    every run of a flagged experiment see the same wrong pairing, reproducibly.
    """
    return np.random.default_rng([int(seed), CLASSNAME_STREAM]).permutation(num_classes).astype(np.int64)


def prompt_class_names(names: list[str], class_order: np.ndarray | None) -> list[str]:
    """The class name that prompt k (the classifier's class k) is written with: ``names[k]``, in label order (the
    correct pairing), or ``names[class_order[k]]`` for a partition made with bug_compat_classname_order."""
    if class_order is None:
        return list(names)
    if len(class_order) != len(names):
        raise ValueError(f"the partition's class_order has {len(class_order)} entries for {len(names)} class names")
    return [names[int(j)] for j in class_order]
