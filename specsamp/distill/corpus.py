"""Training text for distillation that is never an evaluation prompt.

- Code prompts: functions of the Python standard library on this machine, given as a
  signature plus docstring to complete (the shape of a HumanEval prompt, not its content),
  and instructions built from templates ("Write a Python function that ...").
- Prose prompts: instructions built from templates (explain, describe, summarise a
  paragraph taken from a standard-library module docstring).
- Code corpus: chunks of standard-library source, used as-is (teacher-forced, no sampling).

HumanEval and the XSum test split are never read here. Held-out prompts are drawn from the
same generators but split off by a hash of the prompt, so train and held-out are disjoint.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig

CODE, PROSE = 0, 1
DOMAINS = ("code", "prose")

_OPS = ("reverses", "sorts", "removes duplicates from", "counts the distinct items in",
        "finds the largest element of", "returns the sum of the even numbers in",
        "checks whether a palindrome is formed by", "flattens", "groups by first letter",
        "returns the second smallest value of", "computes a running total of",
        "splits into chunks of size n", "rotates by k positions", "finds the most common item in",
        "validates", "merges two sorted versions of", "computes the median of",
        "encodes with run-length encoding", "filters out negative numbers from",
        "normalises to the range [0, 1]", "returns all pairs that sum to a target from",
        "converts to title case", "counts vowels in", "compresses whitespace in",
        "finds the longest increasing run in", "interleaves two copies of")
_OBJS = ("a list of integers", "a string", "a list of strings", "a dictionary of scores",
         "a list of tuples", "a nested list", "a sentence", "a list of floats",
         "a matrix given as a list of lists", "a binary string", "a list of words",
         "a CSV line", "a list of dates as strings", "a set of numbers")
_CODE_FRAMES = (
    "Write a Python function that {op} {obj}.",
    "Implement a Python function which {op} {obj}. Include a docstring and type hints.",
    "Write Python code that {op} {obj}, and show an example call.",
    "Create a function in Python that {op} {obj}. Keep it short.",
    "Write a Python function that {op} {obj} and handles the empty case.",
)
_TOPICS = ("the water cycle", "photosynthesis", "the history of the printing press",
           "how vaccines work", "the causes of inflation", "a visit to a small fishing town",
           "why the sky is blue", "the rules of chess", "the life of honey bees",
           "how a bill becomes law", "volcanoes", "the benefits of sleep", "a rainy morning",
           "the invention of the telephone", "coral reefs", "how elections are run",
           "the moon landing", "climate change", "a football match report", "recycling",
           "the Roman empire", "learning a second language", "the stock market",
           "how bridges are built", "deserts", "a new museum opening", "public libraries",
           "electric cars", "the Olympic games", "a local bakery", "migrating birds",
           "a storm hitting the coast", "the human heart", "earthquakes", "tea",
           "a city council meeting", "space telescopes", "remote work", "rivers",
           "a school science fair", "the internet", "mountain climbing", "antibiotics")
_PROSE_FRAMES = (
    "Write a short paragraph about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a brief news report about {topic}.",
    "Describe {topic} in three sentences.",
    "What are the main facts about {topic}?",
    "Write a one-paragraph summary of {topic}.",
)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(limit: int | None = None) -> list[str]:
    root = stdlib_dir()
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("test", "tests", "site-packages", "idlelib", "__pycache__"))
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return out[:limit] if limit else out


def _function_prompts(files: list[str], max_per_file: int = 4) -> tuple[list[str], list[str]]:
    """(def+docstring prompts, module docstring paragraphs) from source files."""
    funcs, paras = [], []
    for path in files:
        try:
            src = open(path, encoding="utf-8").read()
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree) or ""
        paras += [p.strip() for p in doc.split("\n\n") if 200 <= len(p.strip()) <= 900
                  and not p.strip().startswith((">>>", "-", "*"))]
        n = 0
        for node in tree.body:
            if n >= max_per_file or not isinstance(node, ast.FunctionDef):
                continue
            fdoc = ast.get_docstring(node, clean=False)
            if not fdoc or len(fdoc) < 40 or node.name.startswith("_"):
                continue
            args = ast.unparse(node.args)
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            body = "\n".join("    " + line.strip() if line.strip() else "" for line in fdoc.strip().splitlines())
            funcs.append(f'def {node.name}({args}){ret}:\n    """{body.strip()}\n    """\n')
            n += 1
    return funcs, paras


def is_heldout(text: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return h / 2**32 < fraction


def prompts(seed: int = 0, heldout_fraction: float = 0.1) -> dict[str, list[tuple[int, str]]]:
    """{'train': [(domain, prompt)], 'heldout': [...]}, shuffled, code and prose interleaved."""
    rng = random.Random(seed)
    funcs, paras = _function_prompts(stdlib_files())
    code = [f.format(op=o, obj=b) for f in _CODE_FRAMES for o in _OPS for b in _OBJS]
    code += [f"Complete the following Python function.\n\n{f}" for f in funcs]
    code += funcs  # the bare def + docstring, as HumanEval prompts arrive in chat form
    prose = [f.format(topic=t) for f in _PROSE_FRAMES for t in _TOPICS]
    prose += [f"Summarize the following text in one sentence.\n\n{p}" for p in paras]
    prose += [f"Rewrite the following text in plain words.\n\n{p}" for p in paras]
    out: dict[str, list[tuple[int, str]]] = {"train": [], "heldout": []}
    for domain, items in ((CODE, code), (PROSE, prose)):
        items = sorted(set(items))
        rng.shuffle(items)
        for p in items:
            out["heldout" if is_heldout(p, heldout_fraction) else "train"].append((domain, p))
    for split in out:
        c = [x for x in out[split] if x[0] == CODE]
        p = [x for x in out[split] if x[0] == PROSE]
        mixed = []
        for i in range(max(len(c), len(p))):  # interleave so any prefix has both domains
            mixed += c[i:i + 1] + p[i:i + 1]
        out[split] = mixed
    return out


def code_chunks(tokenizer, length: int, seed: int = 0, heldout_fraction: float = 0.1):
    """Yield (split, token ids) chunks of `length` tokens of standard-library source."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            src = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        split = "heldout" if is_heldout(path, heldout_fraction) else "train"
        ids = tokenizer.encode(src)
        for i in range(0, len(ids) - length // 2, length):
            yield split, ids[i:i + length]
