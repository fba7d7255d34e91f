"""``ropescale verify --matrix``: the conformance matrix, what each engine does with each rope key that matters.

A row is one declaration: a family's tiny model (:mod:`ropescale.tiny_models`, built from its config class, at the
sizes vLLM's CPU attention takes) with the rope parameters of one key that engines are known to read differently. A
column is an engine as a user runs it: transformers, stock vLLM, vLLM with ropescale's plugin, stock SGLang, SGLang
with the plugin, llama.cpp, and llama.cpp on the GGUF ropescale writes. A stock column serves the checkpoint as a model
publisher writes it (the family's own keys; for llama.cpp, the GGUF llama.cpp's own converter makes of it); a plugin
column serves the same weights and declaration as ropescale writes them (``hf.patch`` then ``save_pretrained``: the
method recorded, each engine's extra key beside it; for llama.cpp, ``ropescale extend DIR DST.gguf`` from the unscaled
model), which is what ``ropescale extend`` gives a user. Each cell is
one ``ropescale verify`` run: exact, different (the key and the size), ignored, refused, short (not served past N),
unexplained or inconclusive.

Cells are written to a results file (JSON lines, replaced whole: never a half line) as each ends, and a run skips
the cells the file already holds for the row as it is (its fingerprint; ``--rerun`` runs them again, after an engine
upgrade): a column whose engine is installed in another environment (vLLM and SGLang each in their own venv here) is
filled in by running the same command there. The table is rendered from the file alone, so every cell comes from a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from unittest import mock

__all__ = ["COLUMNS", "ROWS", "Cell", "Column", "ConverterFailed", "Row", "control", "convert", "gguf_target", "headline",
           "judged", "load", "markdown", "missing", "run", "unscaled"]

ORIGINAL = 16  # tiny_models.ORIGINAL: the rows' trained length
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@dataclass(frozen=True)
class Row:
    """One declaration: ``family`` (a :data:`ropescale.tiny_models.TINY` name) with ``rope`` as its
    ``rope_parameters`` (of its full layers, for a per-layer-type family) and ``config`` (other config fields)."""

    name: str
    key: str  # the rope key (or layout) the row is about
    family: str
    rope: dict
    config: dict = field(default_factory=dict)
    length: int | None = None  # the probe's length (default verify's: twice the original, at most the served)
    # whether a silent cell is judged against the family's control (the model with no scaling): not where the row's
    # key is in the control too (Llama 4's NoPE temperature is not the rope's: a control would hide it)
    controlled: bool = True

    def fingerprint(self) -> str:
        text = json.dumps([self.family, self.rope, self.config] + ([self.length] if self.length else []),
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


#: Every row, in the table's order.
ROWS: tuple[Row, ...] = (
    Row("YaRN x4", "factor", "Llama", YARN),
    Row("YaRN, attention_factor 1.3", "attention_factor", "Llama", {**YARN, "attention_factor": 1.3}),
    Row("YaRN, mscale 0.707 / mscale_all_dim 1.0", "mscale, mscale_all_dim", "Llama",
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
    Row("YaRN, truncate false", "truncate", "Llama", {**YARN, "truncate": False}),
    Row("YaRN, beta_fast 4 / beta_slow 2", "beta_fast, beta_slow", "Llama", {**YARN, "beta_fast": 4.0,
                                                                             "beta_slow": 2.0}),
    Row("Llama 3.1, low/high_freq_factor 2 / 8", "low_freq_factor, high_freq_factor", "Llama",
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
         "original_max_position_embeddings": ORIGINAL}),
    Row("YaRN x4, max_position_embeddings left at the original", "served length past max_position_embeddings",
        "Llama", YARN, {"max_position_embeddings": ORIGINAL}),
    # probed within the original length, where the short table is declared (past it both read the long one)
    Row("LongRoPE short/long tables", "short_factor, long_factor", "Phi-3 / Phi-4-mini",
        {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],  # 12 pairs: head 32 x 0.75
         "long_factor": [1.0 + 0.6 * i for i in range(12)], "original_max_position_embeddings": ORIGINAL},
        length=ORIGINAL),
    Row("LongRoPE, attention_factor 1.2", "attention_factor (longrope)", "Phi-3 / Phi-4-mini",
        {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
         "long_factor": [1.0 + 0.6 * i for i in range(12)], "original_max_position_embeddings": ORIGINAL,
         "attention_factor": 1.2}),
    Row("Dynamic NTK (transformers' dynamic) x4", "rope_type dynamic", "Llama", {"rope_type": "dynamic", "factor": 4.0},
        {"max_position_embeddings": ORIGINAL}),
    Row("YaRN on partial rotary 0.5", "partial_rotary_factor", "GLM-4",
        {**YARN, "partial_rotary_factor": 0.5}),
    Row("YaRN on the full layers only", "per-layer-type tables", "Gemma 3", YARN),
    Row("proportional x2", "proportional's factor", "Gemma 4",
        {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5}),
    # text prompts: every stream at the text position (vLLM serves the vision-language model around the text model)
    Row("YaRN x4 on mRoPE sections", "mrope_section", "Qwen2.5-VL (text)", YARN),
    Row("YaRN x4 on interleaved mRoPE sections", "mrope_interleaved", "Qwen3-VL (text)", YARN),
    Row("YaRN x4 between NoPE layers", "NoPE layers (no_rope_layers)", "SmolLM3", YARN),
    Row("Llama 3.1 x4 on iRoPE, NoPE layers' attention temperature", "NoPE layers' attn_temperature_tuning",
        "Llama 4 (text)", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": ORIGINAL}, controlled=False),
    Row("NTK-alpha 1000 (HunYuan's dynamic + alpha)", "alpha", "HunYuan dense",
        {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0}),
    Row("YaRN with the mscale pair on MLA", "mscale_all_dim (MLA)", "DeepSeek-V3",
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
    # V4's checkpoints: YaRN (attention factor 1.0) on the compressed layers at theta 160000, the sliding layers' main
    # table unscaled at 1e4, a trailing rope slice in pairs (2i, 2i+1)
    Row("YaRN x4 on the compress rope, attention_factor 1.0", "per-rope tables (main / compress)", "DeepSeek-V4",
        {**YARN, "attention_factor": 1.0}),
)


def control(family: str) -> Row:
    """The family's model with no scaling: run on a column only where one of the family's cells there is a silent
    divergence, it tells an engine that serves another model than transformers' even unscaled (vLLM 0.32's CPU
    DeepSeek-V3: MLA kernel, grouped routing) from a wrong rope. Such a cell is inconclusive, not silent."""
    return Row(f"{family}, no scaling (control)", "control", family, {"rope_type": "default"}, controlled=False)


@dataclass(frozen=True)
class Column:
    """An engine as a user runs it: ``verify``'s engine, the environment its process gets, and whether it serves
    the checkpoint as ropescale writes it (a plugin column) or as a model publisher does."""

    name: str
    engine: str
    env: tuple[tuple[str, str], ...] = ()
    ropescale_written: bool = False
    gguf: bool = False  # the engine runs a GGUF made from the checkpoint (:func:`gguf_target`), held to it


#: Every column, in the table's order.
COLUMNS: tuple[Column, ...] = (
    Column("transformers", "transformers"),
    Column("vLLM", "vllm", (("ROPESCALE_VLLM", "0"),)),
    Column("vLLM + ropescale", "vllm", (("ROPESCALE_VLLM", "1"),), ropescale_written=True),
    Column("SGLang", "sglang", (("ROPESCALE_SGLANG", "0"),)),
    Column("SGLang + ropescale", "sglang", (("ROPESCALE_SGLANG", "1"),), ropescale_written=True),
    Column("llama.cpp", "llama.cpp", gguf=True),
    Column("llama.cpp + ropescale", "llama.cpp", ropescale_written=True, gguf=True),
)

#: Known upstream reports of a stock engine's divergence on a row's key: (engine, Row.key) -> where it is tracked; a
#: silent cell of that engine and row names it.
UPSTREAM = {
    ("vllm", "attention_factor"): "vLLM #46280, #48351",
    # its YaRN attention factor code, merged with "TODO: start reading the actual value of mscale" (src/llama-context.cpp)
    ("llama.cpp", "mscale, mscale_all_dim"): "llama.cpp #17945: mscale taken as 1",
}

#: Verdicts that are an engine's silent divergence from the declaration ("short", not served past N, is not: the
#: engine refuses a longer prompt).
SILENT = ("different", "ignored", "unexplained")


@dataclass
class Cell:
    """One run: the row's and column's names, the row's fingerprint, the engine's version, the report's checks
    (``verify.Check`` fields) and text. What the table says of it is computed from the checks (:func:`summary`), so
    a change of wording needs no run."""

    row: str
    column: str
    fingerprint: str
    version: str
    checks: list  # [{name, verdict, detail, distance, bound, formula}]
    detail: str  # the report's text
    seconds: float

    @property
    def key(self) -> tuple[str, str]:
        return self.row, self.column

    @property
    def verdicts(self) -> dict[str, str]:
        return {c["name"]: c["verdict"] for c in self.checks}


def load(results: Path) -> dict[tuple[str, str], Cell]:
    """The cells of a results file, the last one of each (row, column) (an absent file: none; a line of an older
    format, without checks: not run)."""
    cells: dict[tuple[str, str], Cell] = {}
    if not results.exists():
        return cells
    for number, line in enumerate(results.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            if isinstance(fields, dict) and "checks" not in fields and "verdicts" in fields:
                continue  # written before the checks were kept: run again
            cell = Cell(**fields)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{results}:{number}: not a matrix cell ({err}): move the file aside to start anew")
        cells[cell.key] = cell
    return cells


def summary(cell: Cell, engine: str, row_key: str = "") -> tuple[str, bool]:
    """The table's words for a cell, and whether it is a silent divergence: a verdict in :data:`SILENT`, or
    log-probabilities that stop being finite (the engine answers, with garbage)."""
    from .verify import Check

    words, silent = [], False
    for c in (Check(**check) for check in cell.checks):
        if c.ok:
            continue
        garbage = c.verdict == "short" and "not finite" in c.detail
        silent |= c.verdict in SILENT or garbage
        if c.name == "ropescale":  # the reason's first clause (two where short), without the checkpoint's path
            clauses = re.sub(r"^/\S*: ", "", c.detail).split(": ")
            reason = ": ".join(clauses[:2]) if len(": ".join(clauses[:2])) <= 100 else clauses[0]
            words.append(f"refused by ropescale: {reason}")
        elif c.verdict == "different" and c.name == "scaling":
            words.append(f"different: {c.formula} ({c.distance:.2g} nats)")
        elif garbage:
            words.append("not finite from position " + c.detail.split("from position ")[1].split(" ")[0])
        elif c.verdict in ("different", "short"):  # the served length: what the engine serves
            words.append(c.detail.split(":")[0])
        elif c.verdict == "ignored" and c.name == "scaling":
            words.append(f"ignored: plain RoPE ({c.distance:.2g} nats)")
        elif c.verdict == "ignored" and c.name == "rope keys":
            words.append(f"key not read: {c.formula}")
        elif c.verdict == "unexplained":
            words.append(f"unexplained ({c.distance:.2g} nats)")
        else:
            words.append(c.verdict)
    upstream = UPSTREAM.get((engine, row_key))
    if upstream and silent:
        words[-1] += f" [{upstream}]"
    return "; ".join(words) or "exact", silent


def _build(row: Row):
    from . import tiny_models

    return tiny_models.build_served(row.family, row.rope, **row.config)


def _declared_method(text_config):
    """The method a row's (text) config declares, of the layer type ``hf.patch`` extends by default."""
    from . import config as config_lib, verify_declared

    return config_lib.read_config(text_config, verify_declared.extended_layer_type(text_config)).method


def checkpoint(row: Row, work: Path, ropescale_written: bool) -> Path:
    """The row's checkpoint under ``work`` (built once per fingerprint): as a model publisher writes it, or as
    ropescale does (``hf.patch`` of the declared method, then ``save_pretrained``)."""
    from . import files, hf

    folder = work / f"{row.fingerprint()}-{'ropescale' if ropescale_written else 'plain'}"
    if folder.exists():
        return folder
    from .hf import architectures

    model = _build(row)
    if ropescale_written:
        text = model.config.get_text_config()  # a vision-language model's rope is its text model's
        arch = architectures.find(text)
        if arch is not None and arch.fixed_method:  # the config's own method only (DeepSeek's MLA scale)
            hf.patch(model)
        else:
            hf.patch(model, _declared_method(text))
    work.mkdir(parents=True, exist_ok=True)
    with files.atomic_directory(folder) as tmp:
        model.save_pretrained(tmp)
    return folder


def unscaled(row: Row) -> Row:
    """The row's model with no scaling: its layout keys (partial rotary, mRoPE sections) and other config fields kept,
    the same weights (the same seed): what ``ropescale extend DIR DST.gguf`` starts from."""
    from . import tiny_models

    rope = {k: v for k, v in row.rope.items() if k in tiny_models.LAYOUT or k == "rope_theta"}
    return Row(f"{row.name} (unscaled)", "unscaled", row.family, {**rope, "rope_type": "default"}, row.config,
               controlled=False)


class ConverterFailed(ValueError):
    """llama.cpp's converter did not convert a checkpoint: the stock engine's refusal of it."""


def convert(folder: Path, dst: Path, timeout: float = 600.0) -> Path:
    """``dst``: the GGUF llama.cpp's converter (``llamacpp.find_converter``) writes of the tiny checkpoint ``folder``
    (float32), its vocabulary the tiny one of :mod:`ropescale._llamacpp_convert`. Written beside ``dst`` and renamed
    into place; a converter that fails is a :class:`ConverterFailed` with its last lines."""
    from . import _llamacpp_convert, files, llamacpp, tiny_models

    script = llamacpp.find_converter()
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as scratch:
        copy = Path(scratch) / folder.name  # the checkpoint as it is, with a vocabulary the converter reads
        shutil.copytree(folder, copy)
        (copy / _llamacpp_convert.TOKENIZER).write_bytes(_llamacpp_convert.sentencepiece_model(tiny_models.VOCAB))
        part = Path(scratch) / dst.name
        try:
            llamacpp.run_converter(script, copy, part, "f32", launcher=("-m", "ropescale._llamacpp_convert"),
                                   timeout=timeout)
        except ValueError as err:
            raise ConverterFailed(str(err)) from None
        with files.atomic_file(dst) as tmp:
            shutil.copyfile(part, tmp)
    return dst


def gguf_target(row: Row, work: Path, ropescale_written: bool) -> tuple[Path, Path]:
    """The GGUF a llama.cpp column runs, and the checkpoint it is held to (verify's ``declared_by``): llama.cpp's
    converter on the publisher's checkpoint, or what ``ropescale extend DIR DST.gguf`` does with the unscaled model
    (``llamacpp.from_transformers``: its checks, the converter, then ``llamacpp.extend``; the converter here with the
    tiny vocabulary), held to the checkpoint ropescale writes of the same declaration. Built once per fingerprint."""
    from . import llamacpp

    source = checkpoint(row, work, ropescale_written)
    dst = work / f"{source.name}.gguf"
    if dst.exists():
        return dst, source
    if not ropescale_written:
        return convert(source, dst), source
    method = _declared_method(_build(row).config.get_text_config())
    plain = checkpoint(unscaled(row), work, False)
    llamacpp.check_from_transformers(plain, dst, method)  # ropescale's refusals, before any conversion
    converted = work / f"{plain.name}.gguf"
    if not converted.exists():
        convert(plain, converted)
    llamacpp.extend(converted, dst, method)
    return dst, source


def missing(column: Column) -> str | None:
    """What the column's engine lacks here (None: it runs): its package, and for a GGUF column llama.cpp's converter,
    sentencepiece (the converter reads the tiny vocabulary with it) and gguf."""
    from . import llamacpp, verify

    engine = verify.ENGINES[column.engine]
    if not verify.installed(engine.module):
        return f"the {engine.module} package ({engine.install})"
    if column.gguf:
        try:
            llamacpp.find_converter()
        except ValueError as err:
            return str(err)
        lacking = [m for m in ("sentencepiece", "gguf") if not verify.installed(m)]
        if lacking:
            return f"the {' and '.join(lacking)} package{'s' if len(lacking) > 1 else ''} (llama.cpp's converter)"
    return None


def installed(column: Column) -> bool:
    """Whether the column's engine runs here (:func:`missing`)."""
    return missing(column) is None


def run(results: Path, work: Path, rows: Iterable[Row] = ROWS, columns: Iterable[Column] = COLUMNS, *,
        timeout: float = 1800.0, progress: Callable[[str], None] | None = None, rerun: bool = False) -> list[Cell]:
    """Runs every (row, column) cell not yet in ``results`` (every one, ``rerun``) whose engine is installed here,
    writing each to ``results`` as it ends (the file keeps the last cell of each row and column), and the family's
    :func:`control` on a column where one of its cells (run now or before) is silent; the cells run. ``work``: where
    the rows' checkpoints are built."""
    say = progress or (lambda message: None)
    rows, columns = list(rows), [c for c in columns if installed(c)]
    done = load(results)
    results.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    controls_run = set()  # (family, column) whose control this run has run
    for row in rows:
        for column in columns:
            cell = done.get((row.name, column.name))
            if cell is None or cell.fingerprint != row.fingerprint() or rerun:
                say(f"{row.name} on {column.name}")
                cell = _run_cell(row, column, work, timeout)
                done = _record(results, cell)  # as each cell ends: a stopped run resumes from here
                cells.append(cell)
            # a silent cell (just run, or from an earlier run) has its family's control on this column
            if row.controlled and (row.family, column.name) not in controls_run \
                    and summary(cell, column.engine, row.key)[1]:
                controls_run.add((row.family, column.name))
                check = control(row.family)
                prior = done.get((check.name, column.name))
                if prior is None or prior.fingerprint != check.fingerprint() or rerun:
                    say(f"{row.name} on {column.name} is silent: its control, {check.name}")
                    cells += run(results, work, [check], [column], timeout=timeout, progress=progress, rerun=True)
                    done = load(results)
            say(f"{row.name} on {column.name}: {judged(done, row, column)[0]}")
    return cells


def _run_cell(row: Row, column: Column, work: Path, timeout: float) -> Cell:
    """One ``verify`` run of the row's checkpoint on the column's engine (a refusal by ropescale: a refused cell)."""
    from . import verify

    start = time.perf_counter()
    try:
        if column.gguf:
            target, source = gguf_target(row, work, column.ropescale_written)
        else:
            target, source = checkpoint(row, work, column.ropescale_written), None
        with mock.patch.dict(os.environ, dict(column.env)):  # the engine's process inherits it
            report = verify.verify(target, column.engine, timeout=timeout, length=row.length, declared_by=source)
    except ValueError as err:  # a refused cell: by the stock engine's own converter, or by ropescale (to write or
        # to check this declaration)
        by = "scaling" if isinstance(err, ConverterFailed) else "ropescale"
        first = str(err).strip().splitlines()[0]
        return Cell(row.name, column.name, row.fingerprint(), column.engine,
                    [dataclasses.asdict(verify.Check(by, "refused", first))], str(err),
                    round(time.perf_counter() - start, 1))
    return Cell(row.name, column.name, row.fingerprint(), report.version,
                [dataclasses.asdict(c) for c in report.checks], report.text(), round(time.perf_counter() - start, 1))


def _record(results: Path, cell: Cell) -> dict[tuple[str, str], Cell]:
    """Adds ``cell`` to the results file as it is NOW, under an exclusive lock on its folder (the file itself is
    replaced, and a lock file would be left beside it): a run in another engine's environment writing the same file
    meanwhile (each column fills in where its engine is installed) keeps its cells (a copy read at the start would
    drop them). The cells after it."""
    import fcntl

    folder = os.open(results.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        cells = load(results)
        cells[cell.key] = cell
        _write_results(results, cells)
    finally:
        os.close(folder)  # and the lock with it
    return cells


def _write_results(results: Path, cells: dict[tuple[str, str], Cell]) -> None:
    """The results file, one JSON line per cell, replaced whole (written beside it and renamed: Ctrl-C or a crash
    mid-write leaves the previous file, never a half line)."""
    from . import files

    with files.atomic_file(results) as tmp:
        Path(tmp).write_text("".join(json.dumps(dataclasses.asdict(c)) + "\n" for c in cells.values()))


def _current(cells: dict[tuple[str, str], Cell], row: Row, column: Column) -> Cell | None:
    """The cell of (row, column) run for the row as it is now (its fingerprint); None: not run."""
    cell = cells.get((row.name, column.name))
    return cell if cell is not None and cell.fingerprint == row.fingerprint() else None


def judged(cells: dict[tuple[str, str], Cell], row: Row, column: Column) -> tuple[str, bool]:
    """The table's words for (row, column) and whether it is a silent divergence (:func:`summary`), "not run"
    where no cell is; a silent cell whose family's control is not exact on that column (the engine's model is not
    transformers' even unscaled) is inconclusive, with the control's distance."""
    cell = _current(cells, row, column)
    if cell is None:
        return "not run", False
    text, silent = summary(cell, column.engine, row.key)
    check = _current(cells, control(row.family), column) if silent and row.controlled else None
    if check is not None and summary(check, column.engine)[0] != "exact":
        distance = max((c.get("distance") or 0.0 for c in check.checks), default=0.0)
        return (f"inconclusive: {row.family} on {column.name} is {distance:.2g} nats from transformers' with no "
                f"scaling ({text})"), False
    return text, silent


def silent_cells(cells: dict[tuple[str, str], Cell], rows: Iterable[Row] = ROWS,
                 columns: Iterable[Column] = COLUMNS) -> list[Cell]:
    """The cells (of the rows and columns as they are now) that are a silent divergence."""
    return [cell for row in rows for column in columns if (cell := _current(cells, row, column)) is not None
            and judged(cells, row, column)[1]]


def markdown(cells: dict[tuple[str, str], Cell], rows: Iterable[Row] = ROWS,
             columns: Iterable[Column] = COLUMNS) -> str:
    """The table: a row per declaration, a column per engine; a cell not run yet is "not run"."""
    rows, columns = list(rows), list(columns)
    lines = ["| family | declaration | key | " + " | ".join(c.name for c in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for row in rows:
        texts = []
        for column in columns:
            text, silent = judged(cells, row, column)
            texts.append(f"**{text}**" if silent else text)
        lines.append(f"| {row.family} | {row.name} | `{row.key}` | " + " | ".join(texts) + " |")
    versions = sorted({f"{c.name}: {cell.version}" for row in rows for c in columns
                       if (cell := _current(cells, row, c)) is not None and cell.version != c.engine})
    lines += ["", "Bold: a silent divergence (the engine serves something else and says nothing). Engines: "
              + "; ".join(versions) + "."]
    return "\n".join(lines)


MARKDOWN_HEADER = """# The conformance matrix

What each engine does with each rope key that matters: one tiny model per row (`ropescale.matrix.ROWS`), one
`ropescale verify` run per cell. Stock columns serve the checkpoint as a model publisher writes it (llama.cpp: the GGUF
llama.cpp's own converter makes of it); the columns with ropescale serve the same declaration as `ropescale extend`
writes it (llama.cpp: the GGUF `ropescale extend DIR DST.gguf` writes from the unscaled model). Regenerate (each cell
resumes from `docs/matrix.jsonl`; run it in each engine's environment to fill in its columns; llama.cpp's need
`LLAMA_CPP_CONVERTER`, which `scripts/test_llamacpp.sh` unpacks):

    ropescale verify --matrix --results docs/matrix.jsonl --markdown docs/MATRIX.md --readme README.md
"""


def write_markdown(path: Path, cells: dict[tuple[str, str], Cell]) -> None:
    """Writes :data:`MARKDOWN_HEADER` and the table of ``cells`` to ``path`` (whole, or not at all)."""
    from . import files

    with files.atomic_file(path) as tmp:
        Path(tmp).write_text(f"{MARKDOWN_HEADER}\n{markdown(cells)}\n")


README_START, README_END = "<!-- matrix: start -->", "<!-- matrix: end -->"


def readme_parts(readme: Path) -> tuple[str, str]:
    """``readme``'s text before :data:`README_START` and after :data:`README_END` (a ValueError without them)."""
    text = readme.read_text() if readme.is_file() else ""
    if README_START not in text or README_END not in text.split(README_START, 1)[1]:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} block for the matrix's headline")
    head, rest = text.split(README_START, 1)
    return head, rest.split(README_END, 1)[1]


def write_readme(readme: Path, cells: dict[tuple[str, str], Cell]) -> None:
    """Replaces the text between :data:`README_START` and :data:`README_END` in ``readme`` with the headline."""
    from . import files

    head, tail = readme_parts(readme)
    with files.atomic_file(readme) as tmp:
        Path(tmp).write_text(f"{head}{README_START}\n{headline(cells)}\n{README_END}{tail}")


def headline(cells: dict[tuple[str, str], Cell], rows: Iterable[Row] = ROWS,
             columns: Iterable[Column] = COLUMNS) -> str:
    """One sentence per column that has cells: how many rows it serves exactly, silently wrong, refused."""
    rows, out = list(rows), []
    for column in columns:
        run_ = [(row, cell) for row in rows if (cell := _current(cells, row, column)) is not None]
        if not run_:
            continue
        said = [judged(cells, row, column) for row, _ in run_]
        exact = sum(text == "exact" for text, _ in said)
        silent = sum(bad for _, bad in said)
        refused = sum("refused" in cell.verdicts.values() for _, cell in run_)
        short = sum(text.startswith("not served past") for text, _ in said)
        out.append(f"{column.name}: {exact} of {len(run_)} exact, {silent} silently different, {refused} refused, "
                   f"{short} not served past the trained length by default")
    return "; ".join(out) + "."
