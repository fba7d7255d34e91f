"""``ropescale verify``: does an engine apply the rope scaling a checkpoint or GGUF declares? (issue 45, part 3)

What the target declares is read as ropescale reads it (:func:`declared`): the method, its table and attention factor
at the probe's length, the length the target is served to. The engine then runs a synthetic prompt past the original
length (a random block and its repeat, so that the second half's log-probabilities depend on attending back across
the whole distance) in its own process (``_verify_probe.py``: the engine's process holds only what a user's would).
Its prompt log-probabilities are compared with ropescale's forward of the same weights (transformers + ``hf.patch``,
float32) under the declared method and under each way an engine is known to get it wrong (:func:`hypotheses`): the
scaling ignored, one parameter at the value an engine takes when it does not read the key, the attention factor 1
(mscale lost), Resonance's rounding dropped, a dynamic scale fixed at the served length, a raw-key attention ignored.

The verdict has an absolute bound (:data:`BOUNDS`, :func:`bound_for`: the engine's own float32 noise): ``exact``
only when the engine's distance to the declared method (mean |delta log p| over the prompt) is within it; else the
wrong formula within the bound of the engine: ``different`` (the parameter, the engine's and the declared value, the
size of the difference) or ``ignored``; else ``unexplained``, with the size. Also ``short`` (not served past length
N), ``refused`` (the engine said so: not silent) or ``inconclusive`` (no answer, nothing to tell apart). Each check
carries its distance and bound. A rope-like key of the target (or of the overrides passed to the engine) that the
engine did not take is a ``rope keys`` check, ``ignored``, naming it (``_verify_keys``). Exit code 0 when every check
is exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import _verify_keys, scaling
from .verify_check import VERDICTS, Check
from .verify_declared import Declared, declared, local_path, target_kind
from .verify_hypotheses import Hypothesis, hypotheses, label
from .verify_reference import float64_reference, probe_tokens, reference_logprobs, reference_model

__all__ = ["ENGINES", "Check", "Declared", "Hypothesis", "Report", "declared", "hypotheses", "verify"]


@dataclass(frozen=True)
class Engine:
    """An engine ``verify`` probes: its name (``--engine``), the module it needs, what it runs."""

    name: str
    module: str  # imported only when this engine is asked for
    install: str
    targets: tuple[str, ...]  # "dir" (a transformers checkpoint directory), "gguf"
    refusal: str = ""  # why it does not run the other kind of target, and what to do instead


#: Every engine ``verify`` knows (``_verify_probe.PROBES`` runs each, by name).
ENGINES = {e.name: e for e in (
    Engine("transformers", "transformers", "pip install transformers (and gguf, accelerate for a GGUF)",
           ("dir", "gguf")),
    Engine("vllm", "vllm", "pip install vllm (ropescale's plugin loads with it)", ("dir",),
           "vLLM serves the transformers directory: verify the directory the GGUF was made from"),
    Engine("sglang", "sglang", "pip install sglang (ropescale's plugin loads with it; CPU: scripts/setup_sglang.sh)",
           ("dir",), "SGLang serves the transformers directory: verify the directory the GGUF was made from"),
    Engine("llama.cpp", "llama_cpp", "pip install llama-cpp-python (README, llama.cpp)", ("gguf",),
           "llama.cpp runs GGUF files: convert the directory with llama.cpp's convert_hf_to_gguf.py, write the "
           "method into it with `ropescale extend SRC.gguf DST.gguf --method ...`, and verify DST.gguf"),
)}

SAME = 1e-6  # hypotheses whose log-probabilities differ by less (mean nats) cannot be told apart: merged
#: The absolute bound (mean |delta log p|, nats) of an engine's own numerical noise, per engine and the dtype it
#: computes in (the probe's answer "dtype"): "exact" only within it. Measured (docs/DESIGN.md, "Verifying an engine"):
#: float32 engines are 0.5e-6 to 1.4e-6 nats from ropescale's float64 forward of the same formula on the tiny models
#: of the tests; the bound leaves a margin of about 8. A probe's bound is also at least NOISE_MARGIN times its own
#: float32 reference's distance to the float64 one (a deeper model, a longer probe: more float32 noise).
BOUNDS = {("transformers", "float32"): 1e-5, ("vllm", "float32"): 1e-5, ("sglang", "float32"): 1e-5,
          ("llama.cpp", "float32"): 1e-5}
NOISE_MARGIN = 4.0
_ROPE_DICTS = ("rope_parameters", "rope_scaling")  # config keys whose value is a plain dict in every engine

@dataclass
class Report:
    target: str
    engine: str
    version: str
    declared: str
    length: int
    checks: list[Check]
    distances: dict[str, float]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return 0 if all(c.ok for c in self.checks) else 1

    def text(self) -> str:
        lines = [f"ropescale verify {self.target} on {self.version}",
                 f"  declared: {self.declared}",
                 f"  probe: {self.length} tokens, the engine's prompt log-probabilities against ropescale's forward "
                 "of the same weights"]
        lines += [f"  note: {n}" for n in self.notes]
        width = max(len(c.name) for c in self.checks)
        lines += [f"  {c.name:<{width}}  {c.verdict.upper() if not c.ok else 'exact'}: {c.detail}{c.measured()}"
                  for c in self.checks]
        failed = sum(not c.ok for c in self.checks)
        lines.append(f"{'every check passed' if not failed else f'{failed} of {len(self.checks)} checks failed'} "
                     f"(exit {self.exit_code})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"target": self.target, "engine": self.engine, "version": self.version, "declared": self.declared,
                "length": self.length, "checks": [dataclasses.asdict(c) for c in self.checks],
                "distances": self.distances, "notes": self.notes, "exit_code": self.exit_code}


def _run_probe(engine: str, target: Path, tokens: list[int], length: int, timeout: float,
               hf_overrides: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ropescale-verify-") as folder:
        # a copy outside the package: run from its own folder, the script's sys.path[0] would make ropescale's
        # subpackages (ropescale/vllm) shadow the engines
        script, job = Path(folder) / "probe.py", Path(folder) / "job.json"
        script.write_text(Path(__file__).with_name("_verify_probe.py").read_text())
        job.write_text(json.dumps({"engine": engine, "target": str(target), "tokens": tokens, "length": length,
                                   **({"hf_overrides": hf_overrides} if hf_overrides else {})}))
        try:
            run = subprocess.run([sys.executable, str(script), str(job)], capture_output=True, text=True,
                                 timeout=timeout, cwd=folder)
        except subprocess.TimeoutExpired:
            return {"error": f"the engine gave no answer in {timeout:g} s (--timeout)", "crashed": True}
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    if not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return {"error": f"the engine's process ended (exit {run.returncode}) with no answer: " + " | ".join(tail),
                "crashed": True}
    return json.loads(lines[-1][len("PROBE "):])


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().mean().item()


def _served_check(d: Declared, engine: str, max_length: int | None) -> Check:
    if max_length is None:
        return Check("served length", "exact", f"{engine} bounds no length; the target is served to {d.served}")
    gap = dict(distance=float(abs(max_length - d.served)), bound=0.0)
    if max_length < d.served:
        return Check("served length", "short", f"not served past length {max_length}: the engine reads "
                                                f"{max_length}, the target declares {d.served}", **gap)
    if max_length > d.served:
        return Check("served length", "different", f"the engine serves {max_length} tokens, the target declares "
                                                    f"{d.served}: past {d.served} the table is not the one declared",
                     **gap)
    return Check("served length", "exact", f"{max_length} tokens, as declared", **gap)


def bound_for(engine: str, dtype: str, noise: float) -> float | None:
    """The absolute bound of an ``exact`` verdict (:data:`BOUNDS`): the stated one of ``engine`` computing in
    ``dtype``, at least :data:`NOISE_MARGIN` x ``noise`` (the float32 reference's distance to the float64 one on
    this probe); None where no bound is stated (no verdict is then ``exact``)."""
    stated = BOUNDS.get((engine, dtype))
    return None if stated is None else max(stated, NOISE_MARGIN * noise)


def _scaling_check(hs: list[Hypothesis], logprobs: dict[int, torch.Tensor], engine: torch.Tensor,
                   distances: dict[str, float], bound: float | None, dtype: str = "float32") -> Check:
    """The verdict (module docstring): ``exact`` when the engine is within ``bound`` of the declared method; else the
    wrong formula within ``bound`` of the engine (``different`` naming the key, ``ignored``); else ``unexplained``,
    with the size and the nearest formulas."""
    d_declared = _distance(engine, logprobs[0])
    size = (f"mean |delta log p| {d_declared:.3g} nats against the declared "
            f"(max {(engine - logprobs[0]).abs().max():.3g})")
    if len(hs) == 1:  # nothing to tell the declared method from: no verdict
        return Check("scaling", "inconclusive", "at this length every checked formula gives the declared "
                                                "log-probabilities: probe past the original length (--length)",
                     d_declared, bound)
    if bound is None:
        return Check("scaling", "inconclusive", f"no bound is stated for this engine computing in {dtype} "
                                                f"(verify.BOUNDS): {size}", d_declared, bound)
    near = sorted(range(len(hs)), key=lambda i: _distance(engine, logprobs[i]))
    if d_declared <= bound:
        neighbour = min(range(1, len(hs)), key=lambda i: _distance(logprobs[0], logprobs[i]))
        return Check("scaling", "exact", f"mean |delta log p| {d_declared:.3g} nats (the nearest other formula, "
                                         f"{label(hs[neighbour])}, is "
                                         f"{_distance(logprobs[0], logprobs[neighbour]):.3g} away)", d_declared, bound)
    within = [i for i in near if i != 0 and _distance(engine, logprobs[i]) <= bound]
    if not within:
        nearest = ", ".join(f"{label(hs[i])} {distances[label(hs[i])]:.3g}" for i in near[:3])
        return Check("scaling", "unexplained", f"no checked formula explains the engine within the bound "
                                               f"{bound:.3g}: mean |delta log p| to {nearest} nats; {size}",
                     d_declared, bound)
    h = hs[within[0]]
    also = "".join(f"; as near (within the bound), {label(hs[i])}" for i in within[1:])
    at = f" (the engine is {_distance(engine, logprobs[within[0]]):.3g} from it)"
    if h.kind == "ignored":
        return Check("scaling", "ignored", f"{h.says}{at}{also}; {size}", d_declared, bound, label(h))
    return Check("scaling", "different", f"{h.says}: {h.names()}{at}{also}; {size}", d_declared, bound, label(h))


def _planned(answer: dict, d: Declared, length: int, notes: list[str]) -> int:
    """The request's planned length as the engine counted it (prompt + the tokens it asked for), which the reference
    of a per-request method plans too: the probe's own length when the engine does not say."""
    planned = int(answer.get("planned") or length)
    if planned < length:
        raise RuntimeError(f"the engine planned {planned} tokens for a probe of {length}: a probe bug, please report")
    if planned != length and d.method.per_request:
        notes.append(f"the engine planned the request at {planned} tokens (prompt + the tokens it asked for): the "
                     f"reference's per-request table is that length's")
    return planned


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (an engine's package), without importing it."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def verify(target: str | Path, engine: str, *, length: int | None = None, timeout: float = 1800.0,
           declared_by: str | Path | None = None, progress: Callable[[str], None] | None = None,
           hf_overrides: dict | None = None) -> Report:
    """Probes ``engine`` on ``target`` (module docstring). ``length``: the probe's prompt length (default: twice the
    original length, at most the served length). ``declared_by``: the checkpoint whose declaration and weights the
    engine is held to, when ``target`` was made from it by another tool (a GGUF that llama.cpp's
    convert_hf_to_gguf.py wrote from a directory ropescale extended: the converter writes only the rope keys it
    knows). ``hf_overrides``: vLLM's, passed to the engine and written into the declaration (a key the engine does
    not take is named: ``_verify_keys``)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; verify knows {', '.join(ENGINES)}")
    spec = ENGINES[engine]
    shown = str(target)
    target = local_path(target)  # every path absolute, here, before any engine or reference reads one
    source = local_path(declared_by, "declared_by (--declared-by) ") if declared_by is not None else target
    kind = target_kind(target)
    if kind not in spec.targets:
        raise ValueError(f"{engine} does not run a {'GGUF file' if kind == 'gguf' else 'checkpoint directory'}: "
                         f"{spec.refusal}")
    if hf_overrides and engine not in ("vllm", "sglang"):
        raise ValueError(f"hf_overrides (--hf-overrides) are vLLM's and SGLang's (--json-model-override-args): "
                         f"{engine} takes none")
    nested = sorted(k for k, v in (hf_overrides or {}).items() if isinstance(v, dict) and k not in _ROPE_DICTS)
    if engine == "sglang" and nested:
        raise ValueError(f"hf_overrides {', '.join(nested)}: SGLang sets a config key to the value given (a sub-config "
                         "becomes a plain dict), where vLLM merges it: override the sub-config's own keys in its "
                         "config.json instead")
    if not installed(spec.module):
        raise ValueError(f"--engine {engine} needs the {spec.module} package: {spec.install}")
    say = progress or (lambda message: None)
    d = declared(source) if not hf_overrides else _verify_keys.declared_with(source, hf_overrides)
    if length is None:
        length = min(d.served, 2 * d.original) if d.served > d.original else d.served
    if length < 2:
        raise ValueError(f"the probe needs at least 2 tokens, got {length}")
    if length > d.served:
        raise ValueError(f"--length {length}: the probe runs {length} tokens through the model in one forward (in the "
                         f"engine, and in ropescale's float32 reference once per formula it checks), and "
                         f"{source.name} is served to {d.served} tokens ({d.source}): past that it declares nothing "
                         f"to check, so the probe takes at most {d.served} tokens")
    notes = [] if length > d.original else [f"the probe ({length} tokens) does not pass the original length "
                                            f"{d.original}: what happens past it is not seen"]
    tokens = probe_tokens(d.vocab_size, length)
    hs, same = hypotheses(d, length)
    if same:
        notes.append(f"at {length} tokens these rotate as the declared method does (not checked): {', '.join(same)}")
    say(f"{engine}: {length} tokens")
    answer = _run_probe(engine, target, tokens, length, timeout, **({"hf_overrides": hf_overrides} if hf_overrides
                                                                      else {}))
    if "error" in answer:
        hint = ""
        named = [t for t in scaling.ropescale_rope_types() if f"'{t}'" in answer["error"]]
        if engine == "transformers" and named:
            hint = (f" (plain transformers has no rope type {named[0]!r}, one of ropescale's: `import ropescale.hf` "
                    "registers them, then `ropescale.hf.patch(model)` serves it)")
        check = (Check("scaling", "inconclusive", answer["error"]) if answer.get("crashed") else
                 Check("scaling", "refused", f"the engine refused the target: {answer['error']}{hint}"))
        keys = _verify_keys.check(target, engine, answer, hf_overrides)
        return Report(shown, engine, engine, d.describe(), length, [check] + ([keys] if keys else []), {}, notes)
    engine_logprobs = torch.tensor([math.nan if v is None else v for v in answer["logprobs"]], dtype=torch.float64)
    if engine_logprobs.shape != (length - 1,):
        raise RuntimeError(f"{engine} answered {len(engine_logprobs)} log-probabilities for {length - 1} prompt tokens")
    served = _served_check(d, engine, answer.get("max_length"))
    bad = (~torch.isfinite(engine_logprobs)).nonzero()
    usable = length - 1 if len(bad) == 0 else int(bad[0])  # output rows 0..usable-1 are finite
    if usable < length - 1:
        served = Check("served length", "short", f"not served past length {usable}: the engine's log-probabilities "
                                                  f"are not finite from position {usable} on ({len(bad)} of "
                                                  f"{length - 1}); it reads {answer.get('max_length')}")
        if usable == 0:
            return Report(shown, engine, answer.get("version", engine), d.describe(), length,
                          [served, Check("scaling", "inconclusive", "no finite log-probability to compare")], {},
                          notes + list(answer.get("notes", [])))
        notes.append(f"the scaling is judged on the first {usable} positions (the finite ones)")
    engine_logprobs = engine_logprobs[:usable]
    planned, prompt = _planned(answer, d, length, notes), int(answer.get("prompt") or length)
    model = reference_model(source)
    logprobs, unrunnable = {}, []
    for i, h in enumerate(hs):
        say(f"ropescale: {label(h)} ({i + 1} of {len(hs)})")
        try:
            logprobs[i] = reference_logprobs(model, h, tokens, planned, prompt)[:usable]
        except (RuntimeError, ValueError) as err:  # ValueError: hf.patch refused the formula on this model
            if i == 0:  # the declared method itself
                raise
            # a wrong formula this model cannot run (a table narrower than the head its attention rotates, say:
            # plain RoPE under a proportional config's partial_rotary_factor) is no engine's reading of it either
            unrunnable.append(f"{label(h)} ({str(err).strip().splitlines()[0][:100]})")
            continue
        if not torch.isfinite(logprobs[i]).all():
            raise RuntimeError(f"ropescale's forward under {label(h)} is not finite: a ropescale bug, please report")
    if unrunnable:
        notes.append(f"not checked, this model cannot run them: {'; '.join(unrunnable)}")
        hs, logprobs = [hs[i] for i in logprobs], {j: logprobs[i] for j, i in enumerate(logprobs)}
    say("ropescale: the declared method in float64 (the float32 reference's own noise)")
    try:
        noise = _distance(logprobs[0], float64_reference(model, hs[0], tokens, planned, prompt)[:usable])
        measured = f"ropescale's float32 reference is {noise:.3g} from its float64 one"
    except (RuntimeError, TypeError, NotImplementedError) as err:  # a kernel without float64 (grouped_mm's MoE)
        noise, measured = 0.0, f"the float64 reference did not run ({str(err).splitlines()[0][:80]}): the stated bound"
    dtype = str(answer.get("dtype", "float32"))
    bound = bound_for(engine, dtype, noise)
    apart = max(SAME, 2 * bound) if bound is not None else SAME  # nearer: the probe cannot tell them apart
    keep = [i for i in range(len(hs)) if i == 0 or _distance(logprobs[i], logprobs[0]) > apart]
    merged = [label(hs[i]) for i in range(len(hs)) if i not in keep]
    if merged:
        notes.append(f"at {length} tokens these give the declared log-probabilities within {apart:.3g} nats (not "
                     f"checked: the probe cannot tell them apart): {', '.join(merged)}")
    notes.append(f"bound of an exact verdict {'none stated' if bound is None else f'{bound:.3g}'} nats ({engine} in "
                 f"{dtype}; {measured})")
    hs, logprobs = [hs[i] for i in keep], {j: logprobs[i] for j, i in enumerate(keep)}
    distances = {label(h): _distance(engine_logprobs, logprobs[i]) for i, h in enumerate(hs)}
    checks = [served, _scaling_check(hs, logprobs, engine_logprobs, distances, bound, dtype)]
    checks += filter(None, [_verify_keys.check(target, engine, answer, hf_overrides)])
    return Report(shown, engine, answer.get("version", engine), d.describe(), length, checks, distances,
                  notes + list(answer.get("notes", [])))
