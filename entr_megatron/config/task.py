"""The `task` and `sft` sections: what the policy is trained on, and the supervised warm-up. Layer L0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from entr_megatron.config.validate import bad, boolean, choice, integer, number, str_tuple, string

MAX_EVAL_SIZE = 100_000
"""Upper bound of task.eval_size and sft.eval_size: the held-out problems are built in memory at start."""
MAX_SFT_BATCH = 65_536
"""Upper bound of sft.batch_size."""

TaskName = Literal["arithmetic", "math", "calculator", "search", "countdown", "copy"]  # = tasks.TASK_BUILDERS
MULTI_TURN_TASKS = ("calculator", "search")
"""Tasks whose samples are multi-turn tool episodes (rollout.agent)."""
TASK_NAMES: tuple[str, ...] = get_args(TaskName)
ArithmeticOperation = Literal["+", "-", "*"]
ARITHMETIC_OPERATIONS: tuple[str, ...] = get_args(ArithmeticOperation)
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
CountdownOperation = Literal["+", "-", "*", "/"]
COUNTDOWN_OPERATIONS: tuple[str, ...] = get_args(CountdownOperation)
# the keys of tasks.countdown.VARIANT_SETS and tasks.countdown_rules.LAYOUTS (a unit test asserts that they agree)
CountdownLayout = Literal["compact", "spaced"]
VariantSet = Literal["separators", "structural", "structural_digits", "structural_forced_digits", "spaces"]
VARIANTS_PER_CHARACTER = {"separators": 1, "structural": 2, "structural_digits": 2, "structural_forced_digits": 2,
                          "spaces": 2}
"""How many variants each character of a countdown variant set has (tasks.countdown.VARIANT_SETS)."""
SearchWorld = Literal["fixed", "per_episode"]
"""Where the search task's questions are asked: one fixed corpus, or a new small world per question."""


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Synthetic multi-digit arithmetic, generated locally; exact-match reward."""

    SECTION = "task.arithmetic"

    digits: int = 2
    """Digits of each operand (1 .. 10^digits - 1). In [1, 9]."""

    operations: tuple[ArithmeticOperation, ...] = ("+", "-")
    """Operators drawn uniformly, from ARITHMETIC_OPERATIONS."""

    reverse_answer: bool = False
    """Write answers least significant digit first (far easier for a tiny causal model)."""

    pad_operands: bool = False
    """Operands with leading zeros to `digits` places ("07+45="): fixed digit positions."""

    format_reward: float = 0.0
    """Reward of a wrong but well-formed answer (an integer, then EOS). In [0, 1)."""

    def __post_init__(self) -> None:
        integer(self, "digits", low=1, high=9)
        boolean(self, "reverse_answer")
        boolean(self, "pad_operands")
        number(self, "format_reward", 0, 1)
        if self.format_reward >= 1.0:
            raise bad(self, "format_reward", self.format_reward, "must be < 1 (a correct answer earns 1)")
        str_tuple(self, "operations", ArithmeticOperation)
        if not self.operations:
            raise bad(self, "operations", [], f"must name at least one of {', '.join(ARITHMETIC_OPERATIONS)}")


@dataclass(frozen=True)
class CountdownTaskConfig:
    """Countdown with a scratchpad (tasks/countdown.py, docs/tasks.md): combine the numbers into
    the target, one step at a time, restating what remains; reward 1 when every step is valid."""

    SECTION = "task.countdown"

    num_operands: int = 4
    """Numbers per problem, each used exactly once (num_operands - 1 steps). In [2, 6]."""

    min_number: int = 1
    """Smallest starting number. In [0, max_number]."""

    max_number: int = 9
    """Largest starting number. In [min_number, max_value]."""

    max_value: int = 99
    """Largest value a step may produce (a rule of the task: larger results make the step invalid). In [1, 10^6]."""

    min_target: int = 10
    """Smallest target. In [0, max_target]."""

    max_target: int = 99
    """Largest target. In [min_target, max_value]."""

    operations: tuple[CountdownOperation, ...] = ("+", "-", "*")
    """Operators a step may use, from COUNTDOWN_OPERATIONS ("-" only without a negative result, "/" only exact)."""

    format_reward: float = 0.0
    """Reward of a well-formed response that is wrong (steps, "ans" and an integer, then EOS). In [0, 1)."""

    separator_variants: float = 0.0
    """Chance that a warm-up trace writes a character of `variant_set` as each of its variants; above 0
    the reward and the token labels read a variant as its character. It plants rare tokens at
    positions the model is sure of (the long-tail testbed, docs/studies/lm_tail). In [0, 0.5), and
    below 0.25 with the two-variant sets (a character stays the commoner way)."""

    variant_set: VariantSet = "separators"
    """Which characters have variants: "separators" ("," ":" " " as ";" "|" "_"), "structural" (two
    each: "," as ";" "&", ":" as "|" "!", " " as "_" "#", "=" as "~" "@"), "structural_digits"
    (structural's, and each digit d as two capitals: "A"-"J" and "K"-"T" for 0-9) or
    "structural_forced_digits" (the same, a digit varied only where the text before it determines it)
    or "spaces" (the space alone, as "_" "#")."""

    layout: CountdownLayout = "compact"
    """How a response is written: "compact" ("9*7=63:3 1 63,ans 59") or "spaced" (a space each side of
    every operator and of "=" ":" ",": "9 * 7 = 63 : 3 1 63 , ans 59")."""

    def __post_init__(self) -> None:
        integer(self, "num_operands", low=2, high=6)
        integer(self, "max_value", low=1, high=10**6)
        integer(self, "max_number", low=0, high=self.max_value)
        integer(self, "min_number", low=0, high=self.max_number)
        integer(self, "max_target", low=0, high=self.max_value)
        integer(self, "min_target", low=0, high=self.max_target)
        str_tuple(self, "operations", CountdownOperation)
        if not self.operations or len(set(self.operations)) != len(self.operations):
            raise bad(self, "operations", list(self.operations),
                      f"must name at least one of {', '.join(COUNTDOWN_OPERATIONS)}, each once")
        number(self, "format_reward", 0, 1)
        if self.format_reward >= 1.0:
            raise bad(self, "format_reward", self.format_reward, "must be < 1 (a correct response earns 1)")
        choice(self, "variant_set", VariantSet)
        choice(self, "layout", CountdownLayout)
        # the character stays the commoner way
        number(self, "separator_variants", 0, 0.5 / VARIANTS_PER_CHARACTER[self.variant_set], high_open=True)


@dataclass(frozen=True)
class CopyTaskConfig:
    """Copy a line of Python from the standard library's test suites (tasks/copy_lines.py): every
    response token is determined by the prompt; reward 1 for an exact copy. Needs a BPE model
    (model.path), as the long-tail testbed's."""

    SECTION = "task.copy"

    min_tokens: int = 12
    """The shortest line kept, in tokens of the model's tokenizer. In [1, 512]."""

    max_tokens: int = 24
    """The longest line kept. In [min_tokens, 512]; model.max_prompt_len must hold it + 2 (BOS, newline)."""

    max_token_id: int | None = None
    """Keep only lines whose every token id is below this (the BPE numbers its merges in the order it
    learned them, most frequent pair first, so a low cap keeps lines of common tokens). Null (the
    default): every line; else an integer >= 1."""

    sft_split_prob: float = 0.0
    """The warm-up's sampled tokenizations: each token of a training answer that spells two or more
    characters is, with this probability, written as two parts cut at a uniform character boundary,
    each part encoded by the BPE (the same text, so the same reward). 0: the BPE's own tokenization
    only. Held-out answers (the warm-up's expected accuracy) and prompts keep the BPE's. In [0, 0.5]."""

    def __post_init__(self) -> None:
        integer(self, "min_tokens", low=1, high=512)
        integer(self, "max_tokens", low=self.min_tokens, high=512)
        integer(self, "max_token_id", low=1, optional=True)
        number(self, "sft_split_prob", low=0, high=0.5)


@dataclass(frozen=True)
class MathTaskConfig:
    """Math problems from JSONL/Parquet files; math-verify reward."""

    SECTION = "task.math"

    train_files: tuple[str, ...] = ()
    """Training problems (.jsonl, .json or .parquet). Required when task.name is 'math'."""

    eval_files: tuple[str, ...] = ()
    """Held-out problems; empty: task.eval_size problems of the training files (those with the
    smallest hash of their text: the same ones for every seed) are held out of training instead."""

    prompt_key: str = "problem"
    """Field (column) holding the problem text; tried first, then 'prompt' and 'problem'."""

    answer_key: str = "answer"
    """Field (column) holding the reference answer; tried first, then 'answer' and 'solution'."""

    prompt_template: str = "{problem}"
    """The prompt around the problem text (`{problem}`; literal braces as `{{ }}`). The default, the
    bare problem, costs no tokens of model.max_prompt_len (the data may carry its own instruction);
    examples/qwen3_*.yaml ask for a boxed answer (tasks.math_data.BOXED_TEMPLATE)."""

    def __post_init__(self) -> None:
        for name in ("train_files", "eval_files"):
            str_tuple(self, name)
            for file in getattr(self, name):
                if not file.endswith(DATA_FILE_SUFFIXES):
                    raise bad(self, name, file, f"files must end with one of {', '.join(DATA_FILE_SUFFIXES)}")
        string(self, "prompt_key")
        string(self, "answer_key")
        string(self, "prompt_template")
        try:
            filled = self.prompt_template.format(problem="\0")
        except (KeyError, IndexError, ValueError):
            filled = ""
        if "\0" not in filled:
            raise bad(self, "prompt_template", self.prompt_template,
                      "must contain {problem} and no other {field} (literal braces as {{ }})")


@dataclass(frozen=True)
class CalculatorTaskConfig:
    """Multi-turn arithmetic where the model may call a calculator tool."""

    SECTION = "task.calculator"

    digits: int = 3
    """Digits of each operand ("a*b+c=" with a, b, c < 10^digits). In [1, 9]."""

    def __post_init__(self) -> None:
        integer(self, "digits", low=1, high=9)


@dataclass(frozen=True)
class SearchTaskConfig:
    """Multi-hop questions over a generated corpus, answered with a BM25 `search` tool and `open`
    (BrowseComp-Plus style); exact-match reward on the final answer."""

    SECTION = "task.search"

    world: SearchWorld = "fixed"
    """'fixed': one corpus of num_entities entities that every question is asked of (a tiny model
    memorises its facts instead of learning to read: docs/DEMOS.md, "The CPU agent demo"). 'per_episode':
    every question is asked of its own world of num_entities entities, named by a tag in the prompt
    ("w4821 q: home of founder of velora?") and drawn from it and corpus_seed
    (tasks/search_worlds.py), so an answer can only be read, never recalled; the splits are
    drawn by tag: held-out questions never share a world with training ones."""

    name_pool: int | None = None
    """World 'per_episode': every world names its entities from one vocabulary of this many invented
    names (drawn from corpus_seed), so a name is a familiar word a tiny character-level model
    completes after its first letters; the links, and so the answers, stay per world. None: fresh
    names in every world (slower for a tiny model to learn to copy). >= num_entities."""

    num_entities: int = 48
    """Invented entities in the corpus, one document each (world 'per_episode': in each question's
    world, e.g. 8, two of each kind). >= 8."""

    hops: int = 2
    """Searches a question needs (2 or 3)."""

    top_k: int = 1
    """Passages one search returns. >= 1."""

    corpus_seed: int = 0
    """Which corpus (the same seed, the same documents and questions; world 'per_episode': the same
    questions and worlds). >= 0."""

    python_tool: bool = False
    """Also offer a sandboxed `python` tool (tasks/tools/sandbox.py: its own process, CPU-time,
    memory, output and rollout.agent.tool_timeout_s wall-clock limits, no network, no files
    outside a scratch directory)."""

    python_tool_allow_weak_containment: bool = False
    """Run the python tool even where the kernel cannot confine its reads to its scratch directory
    (no user or mount namespaces, no pivot_root): its audit hook is then the only wall, and native
    code (readline, sqlite3) can read any file the training user can. False: the task refuses to
    build there (tasks/tools/sandbox.py: what is contained)."""

    sft_questions: int | None = None
    """Training questions with a demonstration (the SFT warm-up's expert traces: a fixed subset); RL
    draws from every training question. None: all of them (the only choice with world 'per_episode',
    where every question is new). >= 1."""

    fuzzy_search: bool = False
    """Index words and their character trigrams: a misspelt name still finds its document (exact
    words only when false)."""

    def __post_init__(self) -> None:
        choice(self, "world", SearchWorld)
        integer(self, "num_entities", low=8, high=2000)
        integer(self, "sft_questions", low=1, optional=True)
        if self.world == "per_episode" and self.sft_questions is not None:
            raise bad(self, "sft_questions", self.sft_questions, "must be null (every question is new)",
                      when="world='per_episode'")
        if self.name_pool is not None and self.world != "per_episode":
            raise bad(self, "name_pool", self.name_pool, "must be null (the fixed corpus names its own entities)",
                      when=f"world={self.world!r}")
        integer(self, "name_pool", low=self.num_entities, high=2000, optional=True)
        boolean(self, "fuzzy_search")
        integer(self, "hops", low=2, high=3)
        integer(self, "top_k", low=1, high=10)
        integer(self, "corpus_seed", low=0)
        boolean(self, "python_tool")
        boolean(self, "python_tool_allow_weak_containment")
        if self.top_k > self.num_entities:
            raise bad(self, "top_k", self.top_k, f"must be <= num_entities ({self.num_entities})")


@dataclass(frozen=True)
class TaskConfig:
    """What the policy is trained on and how it is rewarded."""

    SECTION = "task"

    name: TaskName = "arithmetic"
    """One of TASK_NAMES; its options live in the section of the same name."""

    eval_size: int = 200
    """Held-out problems scored before/after training and every controller.eval_interval. In [0,
    MAX_EVAL_SIZE]; 0: no evaluation (`eval` then needs --n)."""

    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    """Options of the 'arithmetic' task."""

    math: MathTaskConfig = field(default_factory=MathTaskConfig)
    """Options of the 'math' task."""

    calculator: CalculatorTaskConfig = field(default_factory=CalculatorTaskConfig)
    """Options of the 'calculator' task."""

    search: SearchTaskConfig = field(default_factory=SearchTaskConfig)
    """Options of the 'search' task."""

    countdown: CountdownTaskConfig = field(default_factory=CountdownTaskConfig)
    """Options of the 'countdown' task."""

    copy: CopyTaskConfig = field(default_factory=CopyTaskConfig)
    """Options of the 'copy' task."""

    def __post_init__(self) -> None:
        choice(self, "name", TaskName)
        integer(self, "eval_size", low=0, high=MAX_EVAL_SIZE)
        if self.name == "math" and not self.math.train_files:
            raise bad(self, "math.train_files", [], "task.name='math' needs at least one .jsonl/.json/.parquet file")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up before RL (RL from random weights learns nothing)."""

    SECTION = "sft"

    steps: int = 200
    """Optimizer steps of the warm-up. >= 1."""

    lr: float = 1e-3
    """Constant learning rate of the warm-up. > 0."""

    batch_size: int = 32
    """Sequences per warm-up step. In [1, MAX_SFT_BATCH]."""

    data_files: tuple[str, ...] = ()
    """Demonstrations (.jsonl/.json/.parquet with prompt and response). Empty: generated by the task."""

    target_accuracy: float | None = None
    """Stop the warm-up early once the held-out expected exact-match accuracy at temperature 1 (the
    mean over eval_size problems of p(reference answer), computed teacher-forced on the learner) is
    at least this; it equals the expected eval/sampled_accuracy of a task whose reward is exact match
    (arithmetic). This makes RL start from the same accuracy on any machine, where a fixed step count
    lands wherever the machine's float rounding takes a fast-changing warm-up. None: all `steps`.
    In (0, 1]; needs a task that generates SFT data."""

    eval_interval: int = 10
    """Steps between held-out checks of target_accuracy (logged as sft/expected_accuracy). >= 1."""

    eval_size: int = 256
    """Held-out problems of each check. In [1, MAX_EVAL_SIZE]."""

    def __post_init__(self) -> None:
        integer(self, "steps", low=1)
        number(self, "lr", low=0, low_open=True)
        integer(self, "batch_size", low=1, high=MAX_SFT_BATCH)
        str_tuple(self, "data_files")
        if self.target_accuracy is not None:
            number(self, "target_accuracy", low=0, high=1, low_open=True)
            if self.data_files:
                raise bad(self, "target_accuracy", self.target_accuracy,
                          "is checked on problems the task generates; with sft.data_files use null")
        integer(self, "eval_interval", low=1)
        integer(self, "eval_size", low=1, high=MAX_EVAL_SIZE)
