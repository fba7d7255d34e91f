"""The conformance matrix (issue 57, ``ropescale verify --matrix``): its cells come from verify runs, a planted engine
defect turns its cell from exact to "different" naming the key, a run resumes from its results file, and the table is
rendered from the file alone. The transformers column only (the engines' columns run in their own environments:
docs/MATRIX.md)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ropescale import cli, matrix, verify  # noqa: E402
from support import planted  # noqa: E402

TRANSFORMERS = matrix.COLUMNS[0]
FACTOR_ROW = next(r for r in matrix.ROWS if r.key == "attention_factor")


def test_rows_and_columns_are_named_once_and_every_column_is_a_verify_engine():
    assert len({r.name for r in matrix.ROWS}) == len(matrix.ROWS)
    assert len({c.name for c in matrix.COLUMNS}) == len(matrix.COLUMNS)
    assert {c.engine for c in matrix.COLUMNS} <= set(verify.ENGINES)
    assert TRANSFORMERS.engine == "transformers" and not TRANSFORMERS.ropescale_written
    # a plugin column exists for every engine with a stock column but transformers (whose "plugin" is hf.patch)
    assert {c.engine for c in matrix.COLUMNS if c.ropescale_written} == {"vllm", "sglang", "llama.cpp"}
    # llama.cpp runs a GGUF made from the row's checkpoint: its columns only
    assert {c.engine for c in matrix.COLUMNS if c.gguf} == {"llama.cpp"} == {
        e.name for e in verify.ENGINES.values() if "dir" not in e.targets}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The attention_factor row's cell on plain transformers."""
    folder = tmp_path_factory.mktemp("matrix")
    cells = matrix.run(folder / "results.jsonl", folder / "work", [FACTOR_ROW], [TRANSFORMERS])
    return folder, cells


def test_a_cell_is_a_verify_run_written_as_it_ends(clean):
    folder, cells = clean
    assert [(c.row, c.column) for c in cells] == [(FACTOR_ROW.name, "transformers")]
    assert matrix.summary(cells[0], "transformers", FACTOR_ROW.key) == ("exact", False)
    assert cells[0].verdicts == {"served length": "exact", "scaling": "exact"}
    assert "ropescale verify" in cells[0].detail and cells[0].version.startswith("transformers ")
    on_disk = matrix.load(folder / "results.jsonl")
    assert list(on_disk.values()) == cells


def test_a_planted_engine_that_drops_a_key_turns_the_cell_to_different_naming_it(clean, tmp_path, monkeypatch):
    """transformers with its YaRN made to ignore attention_factor (a sitecustomize in the probe's process): the
    cell that was exact says "different: attention_factor=..." and counts as silent."""
    folder, _ = clean
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(planted.TRANSFORMERS_DROPS_ONE_KEY)
    monkeypatch.setenv("ROPESCALE_TEST_DROP", "attention_factor")
    monkeypatch.setenv("PYTHONPATH", str(site))
    cells = matrix.run(tmp_path / "results.jsonl", folder / "work", [FACTOR_ROW], [TRANSFORMERS])
    # the silent cell's control ran: the family unscaled is exact there, so the cell stays silent
    assert [c.row for c in cells] == [FACTOR_ROW.name, matrix.control(FACTOR_ROW.family).name]
    cell = cells[0]
    assert matrix.summary(cells[1], "transformers")[0] == "exact", cells[1].detail
    text, silent = matrix.summary(cell, "transformers", FACTOR_ROW.key)
    assert silent and text.startswith("different: attention_factor="), text
    assert cell.verdicts["scaling"] == "different", cell.detail
    table = matrix.markdown(matrix.load(tmp_path / "results.jsonl"), [FACTOR_ROW], [TRANSFORMERS])
    assert f"**{text}**" in table
    assert matrix.silent_cells(matrix.load(tmp_path / "results.jsonl"), [FACTOR_ROW], [TRANSFORMERS]) == [cell]
    assert "0 of 1 exact, 1 silently different" in matrix.headline(matrix.load(tmp_path / "results.jsonl"),
                                                                    [FACTOR_ROW], [TRANSFORMERS])


def test_a_run_resumes_from_its_results_and_reruns_a_changed_row(clean, monkeypatch):
    folder, cells = clean
    results = folder / "resumed.jsonl"
    results.write_text((folder / "results.jsonl").read_text())
    runs = []

    def fake_verify(target, engine, **kwargs):
        runs.append(target)
        return verify.Report(str(target), engine, "fake 1", "", 8, [verify.Check("scaling", "refused", "no")], {}, [])

    monkeypatch.setattr(verify, "verify", fake_verify)
    assert matrix.run(results, folder / "work", [FACTOR_ROW], [TRANSFORMERS]) == [] and not runs
    changed = dataclasses.replace(FACTOR_ROW, rope={**FACTOR_ROW.rope, "attention_factor": 1.2})
    (cell,) = matrix.run(results, folder / "work", [changed], [TRANSFORMERS])
    assert len(runs) == 1 and matrix.summary(cell, "transformers") == ("refused", False)
    assert matrix.load(results)[cell.key].fingerprint == changed.fingerprint() != FACTOR_ROW.fingerprint()
    # the table shows a row's cell only for the row as it is now
    assert "| refused |" not in matrix.markdown(matrix.load(results), [FACTOR_ROW], [TRANSFORMERS])


def test_the_table_and_headline_come_from_the_file(clean, tmp_path):
    folder, _ = clean
    cells = matrix.load(folder / "results.jsonl")
    table = matrix.markdown(cells)
    assert sum(line.startswith("| ") for line in table.splitlines()) == 1 + len(matrix.ROWS)  # the header, a row each
    factor_line = next(line for line in table.splitlines() if FACTOR_ROW.name in line)
    assert factor_line.split(" | ")[3:5] == ["exact", "not run"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{matrix.README_START}\nold\n{matrix.README_END}\nrest\n")
    matrix.write_readme(readme, cells)
    assert readme.read_text() == (f"intro\n{matrix.README_START}\ntransformers: 1 of 1 exact, 0 silently different, "
                                  f"0 refused, 0 not served past the trained length by default.\n{matrix.README_END}\nrest\n")


def usage_error(argv) -> bool:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return exited.value.code == 2


@pytest.mark.parametrize("argv, message", [
    (["verify", "--matrix", "somewhere"], "no TARGET"),
    (["verify", "--matrix", "--rows", "no-such-row"], "no row matches"),
    (["verify", "./model"], "needs TARGET and --engine"),
    (["verify", "--matrix", "--markdown", "/no/such/folder/M.md"], "its folder does not exist"),
])
def test_bad_matrix_arguments_are_usage_errors(argv, message, capsys):
    assert usage_error(argv)
    assert message in capsys.readouterr().err


def test_a_results_file_that_is_not_the_matrixs_is_refused(tmp_path, capsys):
    results = tmp_path / "other.jsonl"
    results.write_text(json.dumps({"something": "else"}) + "\n")
    assert usage_error(["verify", "--matrix", "--results", str(results)])
    assert "not a matrix cell" in capsys.readouterr().err


def test_a_readme_without_the_matrix_block_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("no block\n")
    monkeypatch.setattr(matrix, "run", lambda *a, **k: pytest.fail("ran"))
    assert usage_error(["verify", "--matrix", "--readme", str(readme), "--results", str(tmp_path / "r.jsonl")])
    assert "no <!-- matrix: start -->" in capsys.readouterr().err


def synthetic(*checks):
    return matrix.Cell("row", "column", "f", "engine 1", [dataclasses.asdict(c) for c in checks], "", 0.0)


@pytest.mark.parametrize("checks, text, silent", [
    ([verify.Check("served length", "exact", "64 tokens"), verify.Check("scaling", "exact", "ok", 1e-7, 1e-5)],
     "exact", False),
    # the engine refuses prompts past 16 (vLLM's LongRoPE default): not silent
    ([verify.Check("served length", "short", "not served past length 16: the engine reads 16, the target declares 64",
                   48.0, 0.0)], "not served past length 16", False),
    # the engine answers garbage from position 16 on: silent
    ([verify.Check("served length", "short", "not served past length 16: the engine's log-probabilities are not finite "
                                             "from position 16 on (15 of 31); it reads 64")],
     "not finite from position 16", True),
    ([verify.Check("scaling", "different", "…", 0.12, 1e-5, "factor=1.0")], "different: factor=1.0 (0.12 nats)", True),
    ([verify.Check("scaling", "ignored", "…", 0.05, 1e-5, "plain RoPE")], "ignored: plain RoPE (0.05 nats)", True),
    ([verify.Check("rope keys", "ignored", "…", formula="rope_scalings")], "key not read: rope_scalings", True),
    ([verify.Check("scaling", "unexplained", "…", 0.0016, 1e-5)], "unexplained (0.0016 nats)", True),
    ([verify.Check("scaling", "refused", "the engine refused the target")], "refused", False),
    ([verify.Check("ropescale", "refused", "patch: no")], "refused by ropescale: patch: no", False),
    # the checkpoint's path left out, the reason's first two clauses kept
    ([verify.Check("ropescale", "refused", "/tmp/w/ab-plain: architecture ['X']: ropescale writes Llama only: more")],
     "refused by ropescale: architecture ['X']: ropescale writes Llama only", False),
    ([verify.Check("ropescale", "refused", "/tmp/w: architecture ['X']: ropescale converts " + "A, " * 40 + "only")],
     "refused by ropescale: architecture ['X']", False),
])
def test_a_cells_words_and_whether_it_is_silent(checks, text, silent):
    assert matrix.summary(synthetic(*checks), "transformers") == (text, silent)


def test_a_silent_cell_of_an_engine_names_its_upstream_report():
    cell = synthetic(verify.Check("scaling", "different", "…", 0.1, 1e-5, "attention_factor=None"))
    assert matrix.summary(cell, "vllm", "attention_factor")[0].endswith("[vLLM #46280, #48351]")
    assert "[" not in matrix.summary(cell, "sglang", "attention_factor")[0]
    assert all(key in {r.key for r in matrix.ROWS} and engine in verify.ENGINES for engine, key in matrix.UPSTREAM)


def test_each_column_runs_its_engine_with_its_environment_and_leaves_ours(clean, monkeypatch):
    """Stock vLLM is vLLM with ROPESCALE_VLLM=0 in the engine's process (which inherits the environment), the plugin
    column with =1; the environment is ours again after each cell."""
    folder, _ = clean
    seen = []

    def fake_verify(target, engine, **kwargs):
        seen.append((engine, os.environ.get("ROPESCALE_VLLM"), Path(target).name.endswith("-ropescale")))
        return verify.Report(str(target), engine, "fake 1", "", 8, [verify.Check("scaling", "exact", "ok")], {}, [])

    monkeypatch.setattr(verify, "verify", fake_verify)
    monkeypatch.setattr(matrix, "installed", lambda column: True)
    monkeypatch.setenv("ROPESCALE_VLLM", "ours")
    vllm_columns = [c for c in matrix.COLUMNS if c.engine == "vllm"]
    matrix.run(folder / "env.jsonl", folder / "work", [FACTOR_ROW], vllm_columns)
    assert seen == [("vllm", "0", False), ("vllm", "1", True)]
    assert os.environ["ROPESCALE_VLLM"] == "ours"


def test_ctrl_c_mid_run_keeps_every_cell_that_ended_and_no_half_line(clean, monkeypatch):
    folder, _ = clean
    results = folder / "interrupted.jsonl"
    calls = []

    def fake_verify(target, engine, **kwargs):
        calls.append(engine)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return verify.Report(str(target), engine, "fake 1", "", 8, [verify.Check("scaling", "exact", "ok")], {}, [])

    monkeypatch.setattr(verify, "verify", fake_verify)
    monkeypatch.setattr(matrix, "installed", lambda column: True)
    with pytest.raises(KeyboardInterrupt):
        matrix.run(results, folder / "work", [FACTOR_ROW], matrix.COLUMNS[:2])
    assert list(matrix.load(results)) == [(FACTOR_ROW.name, matrix.COLUMNS[0].name)]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".interrupted")] == []  # no temporary left


def test_a_run_keeps_the_cells_another_environments_run_writes_meanwhile(clean, monkeypatch):
    """The columns fill in where each engine is installed (vLLM and SGLang in venvs of their own), so two runs may
    write one results file at once: each cell is added to the file as it is when the cell ends. Before, a run wrote
    back the copy it read at its start, and the other run's cells were lost."""
    folder, _ = clean
    results = folder / "shared.jsonl"
    other = matrix.Cell("another row", "vLLM", "f" * 12, "vLLM 0.32.0",
                        [dataclasses.asdict(verify.Check("scaling", "exact", "ok"))], "", 1.0)

    def fake_verify(target, engine, **kwargs):
        with open(results, "a") as f:  # the other environment's run ends a cell meanwhile
            f.write(json.dumps(dataclasses.asdict(other)) + "\n")
        return verify.Report(str(target), engine, "fake 1", "", 8, [verify.Check("scaling", "exact", "ok")], {}, [])

    monkeypatch.setattr(verify, "verify", fake_verify)
    monkeypatch.setattr(matrix, "installed", lambda column: True)
    matrix.run(results, folder / "work", [FACTOR_ROW], matrix.COLUMNS[:1])
    assert set(matrix.load(results)) == {("another row", "vLLM"), (FACTOR_ROW.name, matrix.COLUMNS[0].name)}


def test_a_silent_cell_whose_family_is_not_the_engines_even_unscaled_is_inconclusive(clean, monkeypatch):
    """A cell that would be silent runs its family's control (the model with no scaling) on that column: where the
    control is not exact either (vLLM 0.32's CPU DeepSeek-V3 is 0.035 nats from transformers' with the default rope:
    its MLA kernel and routing), the rope cannot be judged there: inconclusive with the control's distance, not
    silent (before, "unexplained (0.0016 nats)" in bold on both vLLM columns). A control that is exact leaves the
    cell silent; an exact cell runs no control."""
    folder, _ = clean
    ran = []

    def fake_verify(target, engine, **kwargs):
        ran.append(Path(target).name)
        control = len(ran) > 1
        check = verify.Check("scaling", "unexplained", "…", 0.035 if control else 0.0016, 1e-5, "")
        return verify.Report(str(target), engine, "fake 1", "", 8, [check], {}, [])

    monkeypatch.setattr(verify, "verify", fake_verify)
    monkeypatch.setattr(matrix, "installed", lambda column: True)
    results = folder / "control.jsonl"
    matrix.run(results, folder / "work", [FACTOR_ROW], [TRANSFORMERS])
    assert len(ran) == 2 and ran[0] != ran[1]
    cells = matrix.load(results)
    text, silent = matrix.judged(cells, FACTOR_ROW, TRANSFORMERS)
    assert not silent and text.startswith("inconclusive: Llama on transformers is 0.035 nats from transformers' with "
                                          "no scaling (unexplained (0.0016 nats))"), text
    assert matrix.silent_cells(cells, [FACTOR_ROW], [TRANSFORMERS]) == []
    assert "0 silently different" in matrix.headline(cells, [FACTOR_ROW], [TRANSFORMERS])
    matrix.run(results, folder / "work", [FACTOR_ROW], [TRANSFORMERS])  # resumed: nothing runs again
    assert len(ran) == 2
    # a silent cell an earlier run left without its control (run before controls existed) gets it on the next run
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n")
    matrix.run(results, folder / "work", [FACTOR_ROW], [TRANSFORMERS])
    assert len(ran) == 3 and not matrix.judged(matrix.load(results), FACTOR_ROW, TRANSFORMERS)[1]
    # a row whose key is in its control too (Llama 4's NoPE temperature) is never judged against it: silent
    uncontrolled = dataclasses.replace(FACTOR_ROW, controlled=False)
    assert matrix.judged(matrix.load(results), uncontrolled, TRANSFORMERS)[1]
    assert not next(r for r in matrix.ROWS if r.family == "Llama 4 (text)").controlled


def test_a_vision_language_rows_checkpoint_as_ropescale_writes_it(tmp_path):
    """The mRoPE rows' families are served as the vision-language model around the text model: ropescale's
    checkpoint patches the text model's rope (it read the top-level config: AttributeError) and records the method in
    the text config."""
    row = next(r for r in matrix.ROWS if r.key == "mrope_section")
    folder = matrix.checkpoint(row, tmp_path, True)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["rope_parameters"]["rope_type"] == "yarn" and "ropescale" in text


# The llama.cpp columns (the llama.cpp engine itself runs in the opt-in leg, tests/python/engines/
# test_llamacpp_engine.py): the tiny vocabulary the converter reads, the converter's process, refusals, weights.

def test_the_tiny_vocabulary_is_a_sentencepiece_model_with_the_pieces_llama_cpp_looks_up():
    sentencepiece = pytest.importorskip("sentencepiece")
    from ropescale import _llamacpp_convert, tiny_models

    processor = sentencepiece.SentencePieceProcessor(model_proto=_llamacpp_convert.sentencepiece_model(
        tiny_models.VOCAB))
    pieces = [processor.IdToPiece(i) for i in range(processor.vocab_size())]
    assert len(pieces) == len(set(pieces)) == tiny_models.VOCAB
    assert processor.IsUnknown(0) and processor.IsControl(1) and processor.IsControl(2)
    assert pieces[:4] == ["<unk>", "<s>", "</s>", "\n"]  # the line feed llama.cpp's SPM vocabulary loads
    with pytest.raises(ValueError, match="at least 5"):
        _llamacpp_convert.sentencepiece_model(4)


FAKE_CONVERSION = """
class Model:
    def set_vocab(self):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
    def _set_vocab_sentencepiece(self):
        self.vocabulary = "sentencepiece"
def get_model_class(name):
    return Model
"""
FAKE_SCRIPT = """
import sys
from conversion import get_model_class
model = get_model_class("LlamaForCausalLM")()
model.set_vocab()
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "w").write(model.vocabulary + " " + " ".join(sys.argv[1:]))
"""


def fake_converter(folder: Path, script: str = FAKE_SCRIPT) -> Path:
    """A converter script and its ``conversion`` package, as llama.cpp lays them out."""
    (folder / "conversion").mkdir(parents=True)
    (folder / "conversion" / "__init__.py").write_text(FAKE_CONVERSION)
    (folder / "convert_hf_to_gguf.py").write_text(script)
    return folder / "convert_hf_to_gguf.py"


def test_the_converters_process_reads_every_vocabulary_from_sentencepiece_and_passes_its_arguments(tmp_path):
    import subprocess
    import sys

    script = fake_converter(tmp_path / "llama.cpp")
    out = tmp_path / "out.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(matrix.__file__).parents[1])] + sys.path)}
    subprocess.run([sys.executable, "-m", "ropescale._llamacpp_convert", str(script), "model-dir", "--outfile",
                    str(out), "--outtype", "f32"], check=True, env=env)
    # the class's own set_vocab (which refuses the tiny model) was replaced, every argument reached the script
    assert out.read_text() == f"sentencepiece model-dir --outfile {out} --outtype f32"


def test_a_llama_cpp_column_needs_llama_cpp_its_converter_and_sentencepiece(monkeypatch, tmp_path):
    stock = next(c for c in matrix.COLUMNS if c.name == "llama.cpp")
    modules = {"llama_cpp", "sentencepiece", "gguf"}
    monkeypatch.setattr(verify, "installed", lambda module: module in modules)
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(fake_converter(tmp_path / "llama.cpp")))
    assert matrix.installed(stock)
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(tmp_path / "nowhere.py"))
    assert not matrix.installed(stock)
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(fake_converter(tmp_path / "again")))
    modules.discard("sentencepiece")
    assert not matrix.installed(stock)
    assert "sentencepiece package" in matrix.missing(stock)
    modules.discard("llama_cpp")
    assert not matrix.installed(stock) and not matrix.installed(next(c for c in matrix.COLUMNS if c.gguf
                                                                      and c.ropescale_written))
    assert "llama_cpp package" in matrix.missing(stock)


def test_asking_for_an_engines_columns_where_they_cannot_run_says_what_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(verify, "installed", lambda module: module != "sentencepiece")
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(fake_converter(tmp_path / "llama.cpp")))
    results = tmp_path / "results.jsonl"
    assert usage_error(["verify", "--matrix", "--engine", "llama.cpp", "--results", str(results)])
    assert "--engine llama.cpp: its columns do not run here, it needs the sentencepiece package" in \
        capsys.readouterr().err
    assert not results.exists()


@pytest.fixture
def llama_cpp_columns(monkeypatch, tmp_path):
    """Both llama.cpp columns with a converter that fails as llama.cpp's does on a config it cannot read."""
    monkeypatch.setattr(matrix, "installed", lambda column: True)
    failing = FAKE_SCRIPT.replace("model.set_vocab()", "model.set_vocab(); raise KeyError('num_hash_layers')")
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(fake_converter(tmp_path / "llama.cpp", failing)))
    return [c for c in matrix.COLUMNS if c.gguf]


def test_a_checkpoint_llama_cpps_converter_fails_on_is_refused_by_the_stock_column(llama_cpp_columns, tmp_path):
    cells = matrix.run(tmp_path / "results.jsonl", tmp_path / "work", [FACTOR_ROW], llama_cpp_columns[:1])
    assert [c.verdicts for c in cells] == [{"scaling": "refused"}]
    assert "KeyError: 'num_hash_layers'" in cells[0].detail and "converter" in cells[0].detail
    assert not list((tmp_path / "work").glob("*.gguf")) and not list((tmp_path / "work").glob(".*"))  # no part left


@pytest.mark.parametrize("key, reason", [("short_factor, long_factor", "architecture ['Phi3ForCausalLM']"),
                                         ("rope_type dynamic", "llama.cpp cannot run this method")])
def test_what_ropescale_does_not_write_as_a_gguf_is_refused_before_any_conversion(llama_cpp_columns, tmp_path, key,
                                                                                   reason):
    row = next(r for r in matrix.ROWS if r.key == key)
    cells = matrix.run(tmp_path / "results.jsonl", tmp_path / "work", [row], llama_cpp_columns[1:])
    assert [c.verdicts for c in cells] == [{"ropescale": "refused"}]
    assert matrix.summary(cells[0], "llama.cpp")[0].startswith(f"refused by ropescale: {reason}")
    assert not list((tmp_path / "work").glob("*.gguf"))


@pytest.mark.parametrize("row", [r for r in matrix.ROWS if r.family in ("Llama", "GLM-4", "Phi-3 / Phi-4-mini")],
                         ids=lambda r: r.key)
def test_the_unscaled_model_ropescale_extends_has_the_rows_weights_and_layout(row):
    """``llama.cpp + ropescale`` converts the unscaled model and writes the method in; verify holds the GGUF to the
    row's checkpoint as ropescale writes it: the same weights, the same layout keys, no scaling."""
    import torch

    plain = matrix.unscaled(row)
    assert plain.rope["rope_type"] == "default" and plain.config == row.config
    assert {k: v for k, v in plain.rope.items() if k != "rope_type"} == {
        k: v for k, v in row.rope.items() if k == "partial_rotary_factor"}
    scaled, unscaled = matrix._build(row), matrix._build(plain)
    assert unscaled.config.rope_parameters["rope_type"] == "default"
    for (name, a), (_, b) in zip(scaled.state_dict().items(), unscaled.state_dict().items(), strict=True):
        if "inv_freq" not in name and "rotary" not in name:
            assert torch.equal(a, b), name
