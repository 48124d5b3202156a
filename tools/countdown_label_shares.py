"""Share of each token label (docs/tasks.md) in countdown's supervised warm-up traces.

    python tools/countdown_label_shares.py     # writes docs/studies/countdown/sft_token_labels.md

Draws the warm-up's reference traces (`CountdownTask.sft_examples`: a solution drawn uniformly
among each problem's, then EOS) for the fair test's task settings (examples/countdown.yaml: 4
numbers 1-9, targets 10-99, values up to 99) with the operations `+ -` (the example's and the
study's) and `+ - *` (the task's default), and labels every target token as the RL metrics do
(`CountdownTask.token_labels`). No model is involved: the shares are a property of the task.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entr_megatron.tasks.countdown import CountdownTask  # noqa: E402
from entr_megatron.types import TOKEN_LABELS, Sample  # noqa: E402

TRACES, SEED = 4096, 0


def shares(ops: tuple[str, ...]) -> tuple[Counter, int]:
    task = CountdownTask(4, 1, 9, max_value=99, min_target=10, max_target=99, ops=ops)
    counts: Counter = Counter()
    for (prompt, target), problem in zip(task.sft_examples("train", TRACES, SEED),
                                         task.problems("train", TRACES, SEED)):
        sample = Sample(prompt_ids=prompt, response_ids=target, behaviour_logprobs=[0.0] * len(target),
                        versions=[0] * len(target))
        counts.update(task.token_labels(sample, problem))
    return counts, sum(counts.values())


def main() -> int:
    lines = ["<!-- written by `python tools/countdown_label_shares.py`; do not edit by hand -->", "",
             f"# Countdown: token labels of the warm-up's reference traces ({TRACES} train problems, seed {SEED})", "",
             "| operations | tokens | tokens per trace | " + " | ".join(TOKEN_LABELS) + " |",
             "|---|---|---|" + "---|" * len(TOKEN_LABELS)]
    for ops in (("+", "-"), ("+", "-", "*")):
        counts, total = shares(ops)
        lines.append(f"| `{' '.join(ops)}` | {total} | {total / TRACES:.1f} | "
                     + " | ".join(f"{100 * counts[label] / total:.1f}%" for label in TOKEN_LABELS) + " |")
    text = "\n".join(lines) + "\n"
    (ROOT / "docs/studies/countdown/sft_token_labels.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
