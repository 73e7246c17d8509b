"""Real text on any machine, offline and deterministic: the Python standard library as a corpus.

Evaluating a KV-cache quantizer on a model needs real text, and the device machines reach no network.
Every machine with Python carries megabytes of real, human-written text: the standard library's
``.py`` sources (code with comments) and their docstrings (English prose), plus, on Debian-like
systems, the license texts in ``/usr/share/common-licenses``. This module turns them into a byte-level
token stream with a fixed train / eval split and a list of English passages.

    from kvq.integrations.text import byte_tokens, english_texts, describe
    ids = byte_tokens("eval")             # int64 array: each file's bytes, then SEP (= 256)
    prose = english_texts(max_chars=20_000); describe()["files"]   # {'train': ..., 'eval': ...}

The split rule (never random; the same on every machine with the same Python version):

* files: ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, excluding any directory named
  ``site-packages`` / ``dist-packages`` / ``test`` / ``tests`` / ``idlelib`` / ``lib2to3`` /
  ``__pycache__``, and files larger than 200 KB (``MAX_FILE_BYTES``); sorted by relative POSIX path;
* a file is held out for ``"eval"`` when ``int(sha1(relative_posix_path).hexdigest(), 16) % 20 == 0``
  (about 5 % of the files); every other file is ``"train"``; ``"all"`` is both, in path order.

Different Python versions have different standard libraries, so ``describe()`` records the version
and the file counts: write it next to every number computed on this text.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import pathlib
import sys
import sysconfig

import numpy as np

SEP = 256                   # separator token after each file (one past the 256 byte values)
BYTE_VOCAB = 257            # 256 byte values + SEP
EVAL_MODULUS = 20           # a file is held out when sha1(path) % EVAL_MODULUS == 0 (about 5 %)
MAX_FILE_BYTES = 200_000    # larger files (generated tables such as pydoc_data/topics.py) are skipped
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                           "__pycache__"})
LICENSE_DIR = pathlib.Path("/usr/share/common-licenses")
MIN_DOCSTRING_CHARS = 200   # english_texts keeps docstrings at least this long ...
MIN_LETTER_FRACTION = 0.75  # ... whose characters are mostly letters and spaces

SPLITS = ("train", "eval", "all")


def _check_split(split: str) -> str:
    """Return ``split`` if it is one of ``SPLITS``, else raise a ValueError naming the choices."""
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def stdlib_root() -> pathlib.Path:
    """The directory of this interpreter's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_eval_path(rel_posix: str) -> bool:
    """True when the file at relative POSIX path ``rel_posix`` is held out for evaluation."""
    digest = hashlib.sha1(rel_posix.encode("utf-8")).hexdigest()
    return int(digest, 16) % EVAL_MODULUS == 0


@functools.lru_cache(maxsize=None)
def _all_files() -> tuple[tuple[str, pathlib.Path], ...]:
    """Every eligible source file as (relative POSIX path, absolute path), sorted by relative path."""
    root = stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]   # prune excluded trees
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = pathlib.Path(dirpath) / name
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            out.append((path.relative_to(root).as_posix(), path))
    out.sort(key=lambda item: item[0])
    if not out:
        raise FileNotFoundError(f"no standard-library .py files found under {root}")
    return tuple(out)


def stdlib_files(split: str = "train") -> list[pathlib.Path]:
    """The standard library's ``.py`` files of ``split`` ("train", "eval" or "all"), in path order.

    A file belongs to "eval" when the SHA-1 of its relative POSIX path is 0 mod 20, else to "train";
    "all" is the union. See the module docstring for the exclusions.
    """
    _check_split(split)
    files = _all_files()
    if split == "all":
        return [p for _, p in files]
    want_eval = split == "eval"
    return [p for rel, p in files if is_eval_path(rel) == want_eval]


@functools.lru_cache(maxsize=None)
def _tokens_u16(split: str) -> np.ndarray:
    """The byte stream of ``split`` as a cached, read-only uint16 array (SEP after every file)."""
    parts = []
    sep = np.array([SEP], dtype=np.uint16)
    for path in stdlib_files(split):
        parts.append(np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16))
        parts.append(sep)
    arr = np.concatenate(parts)
    arr.setflags(write=False)
    return arr


def byte_tokens(split: str = "train", max_tokens: int | None = None) -> np.ndarray:
    """The files of ``split`` as one token stream: each file's raw bytes (0..255), then ``SEP`` (256).

    Returns a fresh int64 array of shape (N,), truncated to the first ``max_tokens`` tokens when given.
    """
    _check_split(split)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
            raise TypeError(f"max_tokens must be an int or None, got {type(max_tokens).__name__}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    arr = _tokens_u16(split)
    if max_tokens is not None:
        arr = arr[:max_tokens]
    return arr.astype(np.int64)


def _is_english(text: str) -> bool:
    """A crude prose test: long enough, mostly letters and spaces, not a code listing."""
    if len(text) < MIN_DOCSTRING_CHARS:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    if letters / len(text) < MIN_LETTER_FRACTION:
        return False
    code_lines = sum(line.lstrip().startswith((">>>", "...")) for line in text.splitlines())
    return code_lines == 0


def _docstrings(path: pathlib.Path) -> list[str]:
    """Module, class and function docstrings of one file, in ``ast.walk`` order; [] if unparsable."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and _is_english(doc):
                out.append(doc)
    return out


def license_files() -> list[pathlib.Path]:
    """The license texts under ``/usr/share/common-licenses`` (sorted, symlink duplicates dropped)."""
    if not LICENSE_DIR.is_dir():
        return []
    seen, out = set(), []
    for path in sorted(LICENSE_DIR.iterdir()):
        if not path.is_file():
            continue
        real = path.resolve()
        if real in seen:
            continue
        seen.add(real)
        out.append(path)
    return out


@functools.lru_cache(maxsize=None)
def _english_all() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(docstrings, license texts), each in a deterministic order, cached."""
    docs: list[str] = []
    seen: set[str] = set()
    for path in stdlib_files("all"):
        for doc in _docstrings(path):
            if doc not in seen:                    # e.g. the same docstring in two encodings/*.py
                seen.add(doc)
                docs.append(doc)
    licenses = []
    for path in license_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            licenses.append(text)
    return tuple(docs), tuple(licenses)


def english_texts(max_chars: int | None = None) -> list[str]:
    """Real English prose: standard-library docstrings (>= 200 chars, mostly letters), then license texts.

    Docstrings come from every eligible standard-library file (split "all", path order; within a file
    module, class and function docstrings in ``ast.walk`` order, duplicates dropped), followed by the
    files of ``/usr/share/common-licenses`` where that directory exists. With ``max_chars`` the list is
    cut so that the total length is at most ``max_chars`` (the last text truncated to fit).
    """
    if max_chars is not None and (isinstance(max_chars, bool) or not isinstance(max_chars, int)
                                  or max_chars <= 0):
        raise ValueError(f"max_chars must be a positive int or None, got {max_chars!r}")
    docs, licenses = _english_all()
    texts = list(docs) + list(licenses)
    if not texts:
        raise RuntimeError("no English docstrings or license texts found on this machine")
    if max_chars is None:
        return texts
    out, total = [], 0
    for text in texts:
        if total + len(text) > max_chars:
            rest = max_chars - total
            if rest > 0:
                out.append(text[:rest])
            break
        out.append(text)
        total += len(text)
    return out


def describe(english: bool = True) -> dict:
    """The protocol of this corpus as a JSON-ready dict, to write next to results computed on it.

    Names the sources, the Python version and stdlib path, the split rule, and the file / byte / token
    counts per split; with ``english=True`` also the English passages' counts (parses every file once).
    """
    files = {s: len(stdlib_files(s)) for s in ("train", "eval")}
    nbytes = {s: int(sum(p.stat().st_size for p in stdlib_files(s))) for s in ("train", "eval")}
    info = {
        "source": "Python standard library .py files (sysconfig stdlib)",
        "python_version": sys.version.split()[0],
        "python_implementation": sys.implementation.name,
        "stdlib_path": str(stdlib_root()),
        "split_rule": (f"sha1(relative posix path) % {EVAL_MODULUS} == 0 -> eval, else train; "
                       "files sorted by relative path"),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "max_file_bytes": MAX_FILE_BYTES,
        "files": files,
        "bytes": nbytes,
        "tokens": {s: nbytes[s] + files[s] for s in ("train", "eval")},
        "sep_token": SEP,
        "byte_vocab": BYTE_VOCAB,
    }
    if english:
        docs, licenses = _english_all()
        info["english"] = {
            "docstrings": len(docs),
            "docstring_chars": int(sum(len(d) for d in docs)),
            "docstring_rule": (f"module/class/function docstrings >= {MIN_DOCSTRING_CHARS} chars, "
                               f">= {MIN_LETTER_FRACTION:.0%} letters or spaces, no '>>>' lines"),
            "license_dir": str(LICENSE_DIR) if LICENSE_DIR.is_dir() else None,
            "license_files": [p.name for p in license_files()],
            "license_chars": int(sum(len(t) for t in licenses)),
        }
    return info
