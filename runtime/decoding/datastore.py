"""Token stores that model-free drafters look continuations up in (REST, suffix decoding).

A *datastore* is a corpus tokenized with an engine set's tokenizer and indexed for longest-suffix lookup: its tokens
(documents joined by a separator id that no token has, so that no match runs across two) and their suffix array,
as .npy files opened memory-mapped, with a manifest that names the tokenizer it was built with. The *suffix cache*
is the server's own: the outputs of finished requests in one preallocated buffer, the oldest dropped first, so its
memory is fixed when it is made. Both answer one question: where does the longest suffix (up to `max_n` tokens) of
a context occur, and which tokens followed it there.
"""
from __future__ import annotations

import collections
import fnmatch
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import InputError

FORMAT = 1
MANIFEST = "datastore.json"
TOKENS, SUFFIXES = "tokens.npy", "suffixes.npy"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")   # the files a corpus directory contributes
SKIPPED_DIRS = ("__pycache__", "site-packages", ".*")       # and the folders it never enters


class DatastoreError(InputError):
    """A datastore that cannot be built or used as asked: no corpus files, an empty corpus, a missing or broken
    datastore directory (names the path and the fix)."""


class TokenizerMismatchError(DatastoreError):
    """A datastore built with another tokenizer than the engine set's: its ids would mean other text."""


@dataclass(frozen=True)
class Match:
    """Where a context's longest suffix occurs in a store: its length n (0: nowhere) and the tokens that followed
    its occurrences, one row each (M, depth), −1 past a document's end."""
    n: int
    continuations: np.ndarray

    @classmethod
    def none(cls, depth: int) -> "Match":
        return cls(0, np.zeros((0, depth), np.int64))


def _continuations(tokens: np.ndarray, starts: np.ndarray, depth: int, stop: int) -> np.ndarray:
    """(M, depth) tokens from each start, −1 from the first `stop` id (a separator) or the end of `tokens` on."""
    index = starts[:, None] + np.arange(depth)                                         # (M, depth)
    out = np.asarray(tokens[np.minimum(index, len(tokens) - 1)], np.int64)
    out[index >= len(tokens)] = -1
    ended = np.maximum.accumulate(out == stop, axis=1)
    out[ended] = -1
    return out


def _spread(lo: int, hi: int, limit: int) -> np.ndarray:
    """At most `limit` indices spread evenly over lo .. hi−1 (a suffix array's range is sorted by what follows the
    match: its first entries alone would favour the continuations that sort first)."""
    count = hi - lo
    return lo + (np.arange(min(count, limit), dtype=np.int64) * count) // min(count, limit)


def find_in(tokens: np.ndarray, context: np.ndarray, max_n: int, depth: int, limit: int, stop: int = -1,
            exclude_last: bool = False) -> Match:
    """The longest suffix of `context` (up to max_n tokens) in `tokens` by a scan (the context itself, the suffix
    cache): the positions holding its last token, narrowed one token back at a time; the `limit` latest of the
    longest. `exclude_last`: `tokens` is the context, whose own end is no occurrence."""
    end = len(tokens) - 1 if exclude_last else len(tokens)
    if len(context) == 0 or end <= 0:
        return Match.none(depth)
    hits = np.flatnonzero(tokens[:end] == context[-1])                                 # where the suffix ends
    n = 0
    for k in range(1, min(max_n, len(context)) + 1):
        if k > 1:
            keep = hits >= k - 1
            keep[keep] = tokens[hits[keep] - (k - 1)] == context[-k]
            if not keep.any():
                break
            hits = hits[keep]
        elif not len(hits):
            return Match.none(depth)
        n = k
    return Match(n, _continuations(tokens, hits[-limit:] + 1, depth, stop))


class Datastore:
    """A built datastore, memory-mapped (`open`): `lookup` finds the longest suffix of a context in it by binary
    search over the suffix array."""

    def __init__(self, directory: Path, manifest: dict, tokens: np.ndarray, suffixes: np.ndarray):
        self.directory, self.manifest = directory, manifest
        # plain arrays over the same mapped pages: np.memmap's indexing costs ~1 µs more a call, and a lookup's
        # binary searches index them hundreds of times
        self.tokens, self.suffixes = np.asarray(tokens), np.asarray(suffixes)
        self.separator = int(manifest["separator"])

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "Datastore":
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise DatastoreError(f"{directory} has no {MANIFEST}: not a datastore. Build one with `specrt datastore "
                                 f"build CORPUS --engines ENGINES --out {directory}`")
        try:
            manifest = json.loads(path.read_text())
            tokens = np.load(directory / TOKENS, mmap_mode="r")
            suffixes = np.load(directory / SUFFIXES, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DatastoreError(f"datastore {directory}: cannot read it ({e}); rebuild it with `specrt datastore "
                                 "build`") from None
        if manifest.get("format") != FORMAT or len(suffixes) != len(tokens) or \
                len(tokens) != manifest.get("tokens", -1) + manifest.get("documents", 0):
            raise DatastoreError(f"datastore {directory}: format {manifest.get('format')!r}, {len(tokens)} tokens and "
                                 f"{len(suffixes)} suffixes do not match its manifest; rebuild it with `specrt "
                                 "datastore build`")
        return cls(directory, manifest, tokens, suffixes)

    def check_tokenizer(self, identity: dict, engines) -> None:
        """Refuse a datastore whose tokenizer is not the engine set's (`identity`, see tokenizer_identity)."""
        mine = self.manifest["tokenizer"]
        if not same_tokenizer(mine, identity):
            raise TokenizerMismatchError(
                f"datastore {self.directory} was built with tokenizer {_describe(mine)}; the engine set {engines} "
                f"uses {_describe(identity)}: rebuild it with `specrt datastore build ... --engines {engines}`")

    def _range(self, pattern: tuple, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """The suffix array's entries lo .. hi−1 that start with `pattern` (two binary searches)."""
        tokens, sa, n = self.tokens, self.suffixes, len(pattern)
        hi = len(sa) if hi is None else hi
        a, b = lo, hi
        while a < b:   # the first suffix >= pattern
            mid = (a + b) // 2
            p = int(sa[mid])
            if tuple(tokens[p:p + n].tolist()) < pattern:
                a = mid + 1
            else:
                b = mid
        start, b = a, hi
        while a < b:   # the first suffix past the pattern
            mid = (a + b) // 2
            p = int(sa[mid])
            if tuple(tokens[p:p + n].tolist()) <= pattern:
                a = mid + 1
            else:
                b = mid
        return start, a

    def lookup(self, context: np.ndarray, max_n: int, depth: int, limit: int) -> Match:
        """The longest suffix of `context` (up to max_n tokens) found here, by bisection over its length (a suffix
        that occurs has every shorter one occur), and the continuations of at most `limit` of its occurrences."""
        tail = tuple(context[-max_n:].tolist())
        best, found = 0, (0, 0)
        lo, hi = 1, len(tail)
        while lo <= hi:
            n = (lo + hi) // 2
            a, b = self._range(tail[-n:])
            if b > a:
                best, found, lo = n, (a, b), n + 1
            else:
                hi = n - 1
        if not best:
            return Match.none(depth)
        starts = np.asarray(self.suffixes[_spread(*found, limit)], np.int64) + best
        return Match(best, _continuations(self.tokens, starts, depth, self.separator))


class SuffixCache:
    """The server's own outputs (token ids) in one buffer of `megabytes`, made once: each finished output is
    appended after a separator; when it does not fit, the oldest outputs leave first (the rest moves to the front).
    Its memory is the buffer's, whatever the traffic; an output longer than the whole buffer keeps its end."""

    def __init__(self, megabytes: float):
        capacity = int(megabytes * 2 ** 20) // 4
        if capacity < 16:
            raise InputError(f"suffix cache of {megabytes} MB holds {capacity} tokens: give at least 0.001 MB")
        self.buffer = np.full(capacity, -1, np.int32)
        self.used = 0
        self.lengths: collections.deque[int] = collections.deque()   # each output's slots (its tokens and separator)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def outputs(self) -> int:
        return len(self.lengths)

    def add(self, ids) -> None:
        ids = np.asarray(ids, np.int32)[-(len(self.buffer) - 1):]
        need = len(ids) + 1
        drop = 0
        while self.used - drop + need > len(self.buffer):
            drop += self.lengths.popleft()
        if drop:
            self.buffer[:self.used - drop] = self.buffer[drop:self.used]
            self.used -= drop
        self.buffer[self.used:self.used + len(ids)] = ids
        self.buffer[self.used + len(ids)] = -1
        self.used += need
        self.lengths.append(need)

    def lookup(self, context: np.ndarray, max_n: int, depth: int, limit: int) -> Match:
        return find_in(self.buffer[:self.used], context, max_n, depth, limit)


def best_chain(stores, context: np.ndarray, depth: int, max_n: int = 16, min_n: int = 2, limit: int = 64) -> np.ndarray:
    """The most frequent continuation, token by token, of the context's longest suffix (at least min_n tokens) in
    any of `stores`; empty where none matches."""
    best = max((s.lookup(context, max_n, depth, limit) for s in stores), key=lambda m: m.n, default=None)
    if best is None or best.n < min_n:
        return np.zeros(0, np.int64)
    rows, chain = best.continuations, []
    for d in range(depth):
        column = rows[:, d]
        values, counts = np.unique(column[column >= 0], return_counts=True)
        if not len(values):
            break
        chain.append(values[counts.argmax()])
        rows = rows[column == chain[-1]]
    return np.array(chain, np.int64)


def same_tokenizer(a: dict, b: dict) -> bool:
    """Two tokenizer identities (tokenizer_identity) make the same ids: the same tokenizer.json and vocabulary (a
    fine-tune of the model keeps them), or, for engine sets without a tokenizer, the same vocabulary and model."""
    if a.get("tokenizer_sha256") and b.get("tokenizer_sha256"):
        return a["tokenizer_sha256"] == b["tokenizer_sha256"] and a["vocab_size"] == b["vocab_size"]
    return a == b


def _describe(identity: dict) -> str:
    sha = identity.get("tokenizer_sha256")
    return (f"{sha[:12]}… (vocabulary {identity.get('vocab_size')}, of {identity.get('source')})" if sha else
            f"none: token ids of a vocabulary of {identity.get('vocab_size')} (of {identity.get('source')})")


def tokenizer_identity(manifest: dict) -> dict:
    """What a datastore's ids depend on: the engine set's tokenizer.json (its sha256), vocabulary and source."""
    entries = [e for e in manifest.get("tokenizer") or [] if e["file"].endswith("tokenizer.json")]
    target = manifest["models"]["target"]
    return {"tokenizer_sha256": entries[0]["sha256"] if entries else None, "vocab_size": target["vocab_size"],
            "source": target["source"]}


# ---- build ------------------------------------------------------------------------------------------------------
def corpus_files(paths, exclude=()) -> list[Path]:
    """The files of a corpus: each given file, and under each given directory its text, Python and JSONL files
    (not in __pycache__, site-packages, hidden folders or any folder or file that matches an `exclude` pattern)."""
    files = []
    skip = (*SKIPPED_DIRS, *exclude)
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, s) for s in skip))
                files += [Path(root) / f for f in sorted(names) if f.endswith(TEXT_SUFFIXES)
                          and not any(fnmatch.fnmatch(f, s) for s in exclude)]
        else:
            raise DatastoreError(f"corpus {p}: no such file or directory")
    if not files:
        raise DatastoreError(f"corpus {', '.join(map(str, paths))}: no files ({', '.join(TEXT_SUFFIXES)} under a "
                             "directory, or files named one by one)")
    return files


def documents(path: Path, tokenizer):
    """A corpus file's documents, each as text or token ids: a JSONL file's rows ({"text": ...}, {"messages": [...]}
    chat turns, or {"ids": [...], "prompt_len": n}: the answer of `specrt train data`, already ids), else the whole
    file as one text."""
    if path.suffix != ".jsonl":
        yield path.read_text(errors="replace")
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatastoreError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            yield row["text"]
        elif isinstance(row, dict) and isinstance(row.get("ids"), list):
            yield np.asarray(row["ids"][row.get("prompt_len", 0):], np.int64)
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            messages = row["messages"]
            if tokenizer is not None and tokenizer.chat_template:
                yield tokenizer.apply_chat_template(messages, tokenize=False)
            else:
                yield "\n".join(str(m.get("content", "")) for m in messages)
        else:
            raise DatastoreError(f"{path} line {n}: expected an object with 'text' (a string), 'messages' (chat "
                                 "turns) or 'ids' (token ids, with 'prompt_len' to keep the answer only)")


def _check_replaceable(out: Path) -> None:
    """--force replaces a datastore (its datastore.json reads as specrt's: format, tokenizer) or an empty
    directory, nothing else: another program's folder with a datastore.json of its own is not ours to delete."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        info = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        info = None
    if not (isinstance(info, dict) and info.get("format") == FORMAT and isinstance(info.get("tokenizer"), dict)):
        raise DatastoreError(f"{out} exists and is not a specrt datastore (no {MANIFEST} of format {FORMAT} with a "
                             f"tokenizer): --force replaces only a datastore. Choose another --out, or move {out} "
                             "away yourself")


def build(corpus, engines: str | os.PathLike, out: str | os.PathLike, force: bool = False, exclude=(),
          log=print, progress: bool = True) -> dict:
    """Tokenize `corpus` (files and directories, see corpus_files) with the engine set's tokenizer, index it (the
    suffix array of pydivsufsort) and write the datastore to `out`, staged: nothing is at `out` until all of it
    is. Returns its manifest."""
    from pydivsufsort import divsufsort
    from rich.progress import Progress

    from specrt.engines.manifest import read_manifest
    from specrt.files import StagingDir
    out, engines = Path(out), Path(engines)
    if out.exists() and not force:
        raise DatastoreError(f"{out} exists: pass --force to replace it (once the new datastore is complete)")
    _check_replaceable(out)
    manifest = read_manifest(engines)
    identity = tokenizer_identity(manifest)
    vocab = identity["vocab_size"]
    files = corpus_files(corpus, exclude)
    tokenizer = None
    if identity["tokenizer_sha256"]:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(engines / "tokenizer")
        tokenizer.model_max_length = 1 << 62   # whole files: no warning about the model's context length
    began = time.perf_counter()
    parts, count, docs = [], 0, 0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("tokenizing", total=sum(f.stat().st_size for f in files))
        for f in files:
            for doc in documents(f, tokenizer):
                ids = _ids(doc, tokenizer, f, vocab)
                if len(ids):
                    parts += [ids, np.array([vocab], np.int32)]
                    count, docs = count + len(ids), docs + 1
            bar.update(task, advance=f.stat().st_size, description=f"tokenizing ({count:,} tokens)")
    if not count:
        raise DatastoreError(f"corpus {', '.join(map(str, corpus))}: {len(files)} files and no tokens in them")
    tokens = np.concatenate(parts)
    log(f"{count:,} tokens in {docs:,} documents from {len(files)} files; indexing")
    suffixes = divsufsort(tokens)
    info = {"format": FORMAT, "tokenizer": identity, "engines": str(engines), "separator": vocab,
            "sources": [str(p) for p in corpus], "exclude": list(exclude), "files": len(files), "documents": docs, "tokens": count,
            "build_s": round(time.perf_counter() - began, 2),
            "bytes": int(tokens.nbytes + suffixes.nbytes), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with StagingDir(out, force) as tmp:
        np.save(tmp / TOKENS, tokens)
        np.save(tmp / SUFFIXES, suffixes)
        (tmp / MANIFEST).write_text(json.dumps(info, indent=1) + "\n")
    log(f"wrote {out}: {count:,} tokens, {info['bytes'] / 2 ** 20:.1f} MB, {info['build_s']:.1f} s")
    return info


def _ids(doc, tokenizer, path: Path, vocab: int) -> np.ndarray:
    if isinstance(doc, np.ndarray):
        bad = doc[(doc < 0) | (doc >= vocab)]
        if len(bad):
            raise DatastoreError(f"{path}: token id {int(bad[0])} is outside the engine set's vocabulary of {vocab}: "
                                 "the ids were made by another tokenizer")
        return doc.astype(np.int32)
    if tokenizer is None:
        raise DatastoreError(f"{path}: text, and the engine set has no tokenizer: give JSONL rows of token ids "
                             '({"ids": [...]})')
    return np.asarray(tokenizer(doc, add_special_tokens=False)["input_ids"], np.int32)
