"""What the warm start trains on: a prompt's demonstration (the right answer, or the task's
plausible wrong *decoy*; a multi-turn task's whole episode) and its teacher-forcing inputs,
soft targets and loss mask. Invariant: only the model's own tokens (its turns and their
``<eos>``) are trained on, never the prompt's or an environment's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pipeline_rl.models.char_ids import EOS_ID, PAD_ID, encode
from pipeline_rl.tasks.base import Part, Prompt, Task, task_method

if TYPE_CHECKING:
    import torch


def decoy_answer(task_name: str, prompt: Prompt) -> str:
    """A plausible wrong answer: ``sort`` -> the digits as given; ``addition`` -> the sum's
    digits reversed (equal to the right answer when the input is already sorted, or the
    sum a palindrome); ``countdown`` -> stopping one number early, before the zero (an
    off-by-one end: never right)."""
    if task_name == "sort":
        return prompt.text[len("sort "):-1]
    if task_name == "countdown":
        return prompt.answer.rpartition(" ")[0]
    return prompt.answer[::-1]


def demonstration(task: Task, prompt: Prompt, decoy: bool) -> tuple[Part, ...]:
    """What the warm start trains on after ``prompt``: a multi-turn task's own
    ``demonstration(prompt, decoy)`` (model turns and environment replies; a wrapper's
    ``base`` is looked through), else one model turn, the answer or :func:`decoy_answer`."""
    show = task_method(task, "demonstration")
    if show is not None:
        parts: tuple[Part, ...] = show(prompt, decoy)
        return parts
    return ((decoy_answer(task.name, prompt) if decoy else prompt.answer, True),)


def _example_ids(text: str, parts: Sequence[Part]) -> tuple[list[int], list[bool]]:
    """Token ids of a prompt and its parts (each model part followed by ``<eos>``), and
    which of them are trained on (the model's; never the prompt's or an environment's)."""
    ids = encode(text)
    trained = [False] * len(ids)
    for part, by_model in parts:
        piece = encode(part) + ([EOS_ID] if by_model else [])
        ids += piece
        trained += [by_model] * len(piece)
    return ids, trained


def soft_targets(examples: Sequence[tuple[str, Sequence[Part]]], smoothing: float,
                  vocab_size: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Inputs ``[B, L]``, soft targets ``[B, L, V]`` and loss mask ``[B, L]`` for teacher forcing
    on ``(prompt text, parts)`` examples (:func:`demonstration`)."""
    import torch

    digit_list = encode("0123456789")
    digit_set, digit_ids = set(digit_list), torch.tensor(digit_list)
    seqs = [_example_ids(text, parts) for text, parts in examples]
    width = max(len(full) for full, _ in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    targets = torch.zeros((len(seqs), width, vocab_size))
    mask = torch.zeros((len(seqs), width))
    for i, (full, trained) in enumerate(seqs):
        ids[i, :len(full)] = torch.tensor(full)
        for pos, tok in enumerate(full[1:]):    # logits at pos predict token pos + 1
            if not trained[pos + 1]:
                continue
            mask[i, pos] = 1.0
            if tok in digit_set and smoothing > 0:
                targets[i, pos, digit_ids] = smoothing / 10
                targets[i, pos, tok] += 1.0 - smoothing
            else:
                targets[i, pos, tok] = 1.0
    return ids, targets, mask
