"""JSON-lines (or JSON arrays) → packed, fixed-length token rows, with N worker processes.

Two kinds of input, one record per line (or per element of a ``.json`` array):
  - text (pre-training): ``{"text": ...}``; documents are concatenated with EOS between them and
    cut into rows of ``seq_length`` (a document may continue in the next row; nothing is dropped
    but the padding of the last row).
  - sft: ``{"messages": [...]}`` (chat, rendered by ``mindqwen.data.chat``),
    ``{"instruction", "input", "output"}`` (Alpaca, rendered as a one-turn chat) or
    ``{"prompt", "response"}`` (raw text, no template); conversations are packed whole, first fit in
    input order, longer ones truncated to ``seq_length`` (and counted); loss only where
    ``train_on`` says.
  - preference: chosen / rejected pairs in any form ``mindqwen.data.preference`` reads, one pair
    per (2, ``seq_length``) row pair, loss on the responses (one process; ``template`` none: plain
    text and EOS).

Workers tokenize chunks of lines; results are reassembled in input order, so the output is
byte-identical for any worker count. Files are written to a temporary folder and renamed:
``<out>/input_ids.npy``, ``<out>/labels.npy`` (int32 [rows, seq_length], memory-mappable),
``<out>/position_ids.npy`` (text and sft: each token's position in its sample, 0 where one starts)
and ``<out>/manifest.json`` (tokenizer hash, seq_length, counts, padding fraction, skipped lines).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.loader import sample_positions
from mindqwen.data.tokenizer import load_tokenizer
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.textfile import iter_lines

KINDS = ("text", "sft", "preference")
CHUNK = 256  # lines per worker task


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    rows: int = 0
    padding_fraction: float = 0.0
    truncated: int = 0
    skipped: int = 0
    skipped_lines: List[str] = field(default_factory=list)  # "file:line" of the first ten


def tokenizer_hash(path: str) -> str:
    files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path)
                                                       if f.endswith((".json", ".txt", ".tiktoken", ".model")))
    h = hashlib.sha256()
    for name in files:
        with open(name, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


# ---------------------------------------------------------------- per-record work (in workers)
_STATE = {}


def _init_worker(tokenizer_path: str, kind: str, template: str, train_on: str) -> None:
    _STATE.update(tokenizer=load_tokenizer(tokenizer_path), kind=kind, template=template, train_on=train_on)


def _encode_record(record: dict) -> Tuple[List[int], List[int]]:
    """(ids, labels) of one record; ``ValueError`` saying what the record lacks."""
    tok = _STATE["tokenizer"]
    if _STATE["kind"] == "text":
        _need_strings(record, "text")
        ids = tok.encode(record["text"]) + [tok.eos_token_id]
        return ids, ids
    if "prompt" in record or "response" in record:
        _need_strings(record, "prompt", "response")
        prompt, response = tok.encode(record["prompt"]), tok.encode(record["response"]) + [tok.eos_token_id]
        return prompt + response, [IGNORE_INDEX] * len(prompt) + response
    from mindqwen.data.chat import encode_chat
    messages = record.get("messages")
    if messages is None:
        if "instruction" not in record and "output" not in record:
            raise ValueError('expected {"messages": [...]}, {"instruction", "input", "output"} or '
                             '{"prompt", "response"}')
        _need_strings(record, "instruction", "output")
        if not isinstance(record.get("input", ""), (str, type(None))):
            raise ValueError(f'"input" must be a string, got {type(record["input"]).__name__}')
        prompt = record["instruction"] + ("\n\n" + record["input"] if record.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    ids, labels = encode_chat(messages, tok, _STATE["template"], _STATE["train_on"])
    return ids.tolist(), labels.tolist()


def _need_strings(record: dict, *keys: str) -> None:
    for key in keys:
        if key not in record:
            raise ValueError(f'missing "{key}"')
        if not isinstance(record[key], str):
            raise ValueError(f'"{key}" must be a string, got {type(record[key]).__name__}')


def _encode_chunk(chunk: Sequence[Tuple[str, str, str]]):
    """[(where, text, read error)] → [(where, ids, labels) or (where, error)]."""
    out = []
    for where, line, error in chunk:
        try:
            if error:
                raise ValueError(error)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from None
            except RecursionError:
                raise ValueError("not valid JSON (nested too deeply)") from None
            if not isinstance(record, dict):
                raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
            ids, labels = _encode_record(record)  # int32 arrays: cheap to send back from a worker
            out.append((where, np.asarray(ids, np.int32), np.asarray(labels, np.int32)))
        except (TypeError, ValueError) as e:  # UnicodeError (lone surrogates) is a ValueError
            out.append((where, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
    return out


# ---------------------------------------------------------------- packing
def pack_stream(docs: Sequence[Tuple[List[int], List[int]]], seq_length: int, pad_id: int):
    """Concatenate and cut into rows; the last row is padded (labels -100).

    Returns (input_ids, labels, position_ids) [rows, seq_length] int32 and 0 (nothing is
    truncated). Positions restart at every document, and at every row a document continues in,
    so a document cut at a row's end is a new sample there; the padding is a sample of its own.
    """
    ids = np.concatenate([d for d, _ in docs]).astype(np.int32)
    labels = np.concatenate([lab for _, lab in docs]).astype(np.int32)
    rows = -(-len(ids) // seq_length)
    out_ids = np.full(rows * seq_length, pad_id, np.int32)
    out_labels = np.full(rows * seq_length, IGNORE_INDEX, np.int32)
    out_ids[:len(ids)], out_labels[:len(labels)] = ids, labels
    starts = np.zeros(rows * seq_length, bool)
    first = np.cumsum([0] + [len(d) for d, _ in docs])  # every document's first token, then the padding's
    starts[first[first < starts.size]] = True
    starts[::seq_length] = True
    positions = sample_positions(starts.reshape(rows, seq_length))
    return out_ids.reshape(rows, seq_length), out_labels.reshape(rows, seq_length), positions, 0


def pack_whole(docs: Sequence[Tuple[List[int], List[int]]], seq_length: int, pad_id: int):
    """First-fit packing of whole documents into rows, in input order; over-long ones truncated.

    Returns (input_ids, labels, position_ids) [rows, seq_length] int32 and the number truncated.
    Positions restart at every document; a row's padding is a sample of its own.
    """
    rows: List[List[int]] = []
    free: List[int] = []
    truncated = 0
    for i, (d, _) in enumerate(docs):
        n = min(len(d), seq_length)
        truncated += len(d) > seq_length
        slot = next((r for r, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([])
            free.append(seq_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n
    out_ids = np.full((len(rows), seq_length), pad_id, np.int32)
    out_labels = np.full((len(rows), seq_length), IGNORE_INDEX, np.int32)
    starts = np.zeros((len(rows), seq_length + 1), bool)  # one column more: a full row's padding starts past its end
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            d, lab = docs[i]
            n = min(len(d), seq_length)
            out_ids[r, at:at + n], out_labels[r, at:at + n] = d[:n], lab[:n]
            starts[r, at] = True
            at += n
        starts[r, at] = True  # the padding
    return out_ids, out_labels, sample_positions(starts[:, :seq_length]), truncated


# ---------------------------------------------------------------- driver
def preprocess(inputs: Sequence[str], output: str, tokenizer: str, seq_length: int, kind: str = "text",
               workers: int = 1, template: str = "qwen2.5", train_on: str = "assistant",
               skip_bad: bool = False, progress: bool = True) -> Summary:
    """Tokenize and pack ``inputs`` (JSON-lines files) into the folder ``output``.

    Raises:
        ValueError: naming the file and line of the first bad record (unless ``skip_bad``).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if seq_length < 2 or workers < 1:
        raise ValueError("seq_length must be >= 2 and workers >= 1")
    if kind == "preference":
        return _preprocess_pairs(inputs, output, tokenizer, seq_length, template, skip_bad)
    lines = _read_lines(inputs)
    chunks = [lines[i:i + CHUNK] for i in range(0, len(lines), CHUNK)]
    init = (tokenizer, kind, template, train_on)
    docs, summary = [], Summary()
    with tqdm(total=len(lines), desc="tokenizing", unit="doc", disable=not progress) as bar:
        results = _map(chunks, init, workers)
        for chunk in results:
            for item in chunk:
                if len(item) == 2:
                    where, error = item
                    if not skip_bad:
                        raise ValueError(f"{where}: {error}")
                    summary.skipped += 1
                    summary.skipped_lines.append(where) if len(summary.skipped_lines) < 10 else None
                else:
                    docs.append((item[1], item[2]))
            bar.update(len(chunk))
    if not docs:
        raise ValueError(f"{', '.join(inputs)}: no usable records")
    pad = load_tokenizer(tokenizer).pad_token_id
    ids, labels, positions, summary.truncated = (pack_stream if kind == "text" else pack_whole)(docs, seq_length, pad)
    summary.documents, summary.rows = len(docs), len(ids)
    summary.tokens = sum(min(len(d), seq_length) if kind == "sft" else len(d) for d, _ in docs)
    summary.padding_fraction = 1 - summary.tokens / ids.size
    _write(output, ids, labels, positions, {"kind": kind, "seq_length": seq_length, "tokenizer": tokenizer,
                                 "tokenizer_sha256": tokenizer_hash(tokenizer), "template": template,
                                 "train_on": train_on, "inputs": list(inputs), **asdict(summary)})
    return summary


def _preprocess_pairs(inputs: Sequence[str], output: str, tokenizer: str, seq_length: int, template: Optional[str],
                      skip_bad: bool) -> Summary:
    """``preprocess`` of preference pairs: (N, 2, seq_length) rows, chosen then rejected."""
    from mindqwen.data.preference import encode_pairs, read_pairs
    tok, template = load_tokenizer(tokenizer), None if template in (None, "none") else template
    parts, summary = [], Summary()
    for path in inputs:
        data, dropped = encode_pairs(read_pairs(path), tok, seq_length, template, skip_bad, path)
        parts.append(data)
        summary.skipped += dropped
    ids, labels = (np.concatenate([getattr(d, k) for d in parts]) for k in ("input_ids", "labels"))
    summary.documents, summary.rows = len(ids), len(ids)
    summary.tokens = int((ids != tok.pad_token_id).sum())
    summary.padding_fraction = 1 - summary.tokens / ids.size
    _write(output, ids, labels, None, {"kind": "preference", "seq_length": seq_length, "tokenizer": tokenizer,
                                 "tokenizer_sha256": tokenizer_hash(tokenizer), "template": template,
                                 "inputs": list(inputs), **asdict(summary)})
    return summary


def _read_lines(inputs: Sequence[str]) -> List[Tuple[str, Optional[str], Optional[str]]]:
    """[(where, JSON text, read error)] of every record: a JSON-lines file's non-empty lines
    ("file:line"; a line that is not UTF-8 carries its error, to skip or report), or the elements
    of a ``.json`` file holding one array ("file[index]"). A UTF-8 byte-order mark is accepted."""
    lines = []
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: input file not found")
        if not path.endswith(".json"):
            lines += [(f"{path}:{n}", text, error) for n, text, error in iter_lines(path)
                      if error or text.strip()]
            continue
        try:
            with open(path, encoding="utf-8-sig") as f:
                records = json.load(f)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json input holds one array of records")
        lines += [(f"{path}[{i}]", json.dumps(r, ensure_ascii=False), None) for i, r in enumerate(records)]
    return lines


def _map(chunks, init, workers: int):
    """Encoded chunks in input order, as they finish (the progress bar moves while workers run)."""
    if workers == 1:
        _init_worker(*init)
        yield from (_encode_chunk(c) for c in chunks)
        return
    with get_context("spawn").Pool(workers, _init_worker, init) as pool:  # terminated on exit or error
        yield from pool.imap(_encode_chunk, chunks)  # imap keeps input order


def _write(output: str, ids: np.ndarray, labels: np.ndarray, positions: Optional[np.ndarray], manifest: dict) -> None:
    """The folder ``load_packed`` reads; ``positions``: the rows' sample boundaries (None: a row per example)."""
    with atomic_folder(output, replace=False) as staging:
        np.save(os.path.join(staging, "input_ids.npy"), ids)
        np.save(os.path.join(staging, "labels.npy"), labels)
        if positions is not None:
            np.save(os.path.join(staging, "position_ids.npy"), positions)
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)


def load_packed(folder: str, mmap: bool = True):
    """A preprocessed folder as a ``TokenDataset`` (memory-mapped by default), with the rows'
    sample boundaries (``position_ids``) where the folder records them, and its manifest."""
    from mindqwen.data.loader import TokenDataset
    from mindqwen.io.jsonfile import read_json
    manifest = read_json(os.path.join(folder, "manifest.json"), ValueError, "preprocess manifest")
    mode = "r" if mmap else None
    ids = np.load(os.path.join(folder, "input_ids.npy"), mmap_mode=mode)
    labels = np.load(os.path.join(folder, "labels.npy"), mmap_mode=mode)
    positions_file = os.path.join(folder, "position_ids.npy")
    positions = np.load(positions_file, mmap_mode=mode) if os.path.isfile(positions_file) else None
    return TokenDataset(ids, labels, position_ids=positions), manifest
