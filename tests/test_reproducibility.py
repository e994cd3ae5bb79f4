"""The reproducibility contract (docs/reproducibility.md), clause by clause.

For a given model file, dtype, quantization, KV dtype and seed, a line's record does not depend on
the other lines and their order, max_num_seqs, max_num_batched_tokens, the pool size and its
preemptions, prefix caching and its hits, the line's n siblings, other lines' LoRA adapters or
constraints, the thread count, --data-parallel, --resume, or the instruction set of the kernels'
build. Each configuration below (float32, bfloat16, int8 and a GGUF Q4_0, on pagedinfer's own layers,
in Llama, Qwen3, Qwen3-MoE and Qwen2-MoE shapes, a LoRA line mixed in where adapters run) runs one
reference batch of seeded sampling lines with n > 1, logprobs and prompt_logprobs; each clause runs the
same lines again in its own way, and every line's record must come out the same, byte for byte (token
ids, text, logprobs and prompt_logprobs as exact floats, finish reasons).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers as tf
from models import COMMON, DECODER, DRAWN_NORMS, save_lora
from models import CONFIGS as TINY

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.engine.llm_engine import LLMEngine
from pagedinfer.model.random_models import save_random_model

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden = _script("make_golden")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 300) for _ in range(n)]


_rng = random.Random(54)
FIRST = _ids(_rng, 21)  # one full block and 5 tokens
SHARED = FIRST[:BLOCK] + _ids(_rng, 7)  # FIRST's full block again: a prefix-cache hit
SHORT = _ids(_rng, 5)
OTHER = _ids(_rng, 11)


@dataclass(frozen=True)
class Line:
    key: str
    prompt: list[int]
    fields: dict  # SamplingParams' fields, as a batch line gives them
    lora: bool = False  # runs with the configuration's adapter

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(**self.fields)

    def json(self) -> dict:
        """The line as ``pagedinfer run`` reads it."""
        return {"id": self.key, "prompt_token_ids": self.prompt, **self.fields}


def sampled(n: int, seed: int, **more) -> dict:
    return {"n": n, "seed": seed, "max_tokens": 6, "logprobs": 2, "prompt_logprobs": 2, **more}


LINES = [
    Line("first", FIRST, sampled(3, 11)),
    Line("shared", SHARED, sampled(2, 12, temperature=0.8, top_k=40, top_p=0.9)),
    Line("short", SHORT, sampled(2, 13, temperature=1.3, min_p=0.02)),
    Line("lora", OTHER, sampled(2, 14), lora=True),
]


def neighbours(tokenizer: bool) -> list[Line]:
    """Lines that shape their logits (constraints, biases, penalties): run beside the lines, never in them."""
    controls = [
        Line("bias", SHORT, {"n": 2, "seed": 21, "max_tokens": 5, "logit_bias": {"9": 5.0, "10": -100}}),
        Line("allowed", FIRST[:7], {"seed": 22, "max_tokens": 4, "allowed_token_ids": list(range(8, 40))}),
        Line(
            "penalties",
            OTHER,
            {
                "n": 3,
                "seed": 23,
                "max_tokens": 6,
                "repetition_penalty": 1.3,
                "frequency_penalty": 0.5,
                "min_tokens": 3,
            },
        ),
    ]
    if tokenizer:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        controls += [
            Line(
                "regex",
                SHORT,
                {"n": 2, "seed": 24, "max_tokens": 6, "structured_outputs": {"regex": "[a-e]{2,5}"}},
            ),
            Line("json", FIRST, {"seed": 25, "max_tokens": 8, "structured_outputs": {"json": schema}}),
            Line("bad-words", SHARED, {"seed": 26, "max_tokens": 5, "bad_words": ["the", "e"]}),
        ]
    return controls


# -- configurations ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    family: str  # "llama", "qwen3", "olmo2", ..., "gemma3_scaled": tests/models.py's shapes on our own layers
    dtype: str = "float32"
    quantization: str | None = None
    gguf: str | None = None  # a GGUF file of the family's model, its matrices in this type
    kv_cache_dtype: str = "auto"
    lora: bool = False  # the line "lora" runs with an adapter, and other lines with another one


CONFIGS = {
    "llama-float32": Config("llama", lora=True),
    "qwen3-float32": Config("qwen3"),
    "llama-bfloat16": Config("llama", "bfloat16", lora=True),
    "qwen3-bfloat16": Config("qwen3", "bfloat16"),
    "qwen3-int8": Config("qwen3", quantization="int8"),
    "qwen3-float32-kv-bfloat16": Config("qwen3", kv_cache_dtype="bfloat16"),
    "llama-Q4_0": Config("llama", gguf="Q4_0"),
    "qwen3_moe-float32": Config("qwen3_moe"),  # a mixture of experts: rows grouped by expert each step
    "olmo2-float32": Config("olmo2"),  # norms after each branch, q/k norms over all rows
    "granite-float32": Config("granite"),  # its multipliers
    "phi3-float32": Config("phi3"),  # q/k/v and gate/up fused in the checkpoint
    # a sliding window of 8: each row's context starts anywhere in a block, its blocks released
    "mistral-float32": Config("mistral"),
    "qwen2_moe-float32": Config("qwen2_moe"),  # and a shared expert, scaled by a sigmoid, on every row
    # norms of 1 + weight before and after each branch, GeGLU, RoPE per layer type, a logit softcap
    # over windowed layer groups (tests/models.py's gemma3_scaled: windows of 8)
    "gemma3_text-float32": Config("gemma3_scaled"),
    # attention sinks, biases, alternating windows of 8, YaRN, experts with the clamped SwiGLU
    "gpt_oss-float32": Config("gpt_oss"),
}
LORA_CONFIGS = [name for name, c in CONFIGS.items() if c.lora]


def build_model(family: str, text_model: Path, root: Path) -> Path:
    """The tokenizer of ``text_model`` (tests/models.py) with random weights in ``family``'s shape."""
    if family == "llama":
        return text_model
    path = root / f"text-{family}"
    if not (path / "config.json").exists():
        tok = tf.AutoTokenizer.from_pretrained(text_model)
        vocab = {**COMMON, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}
        experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        build = {
            "qwen3": lambda: tf.Qwen3Config(**vocab, **DECODER, head_dim=16),
            "qwen3_moe": lambda: tf.Qwen3MoeConfig(**vocab, **DECODER, head_dim=16, **experts),
            "qwen2_moe": lambda: tf.Qwen2MoeConfig(
                **vocab, **DECODER, **experts, shared_expert_intermediate_size=48
            ),
        }.get(family)
        if build is not None:
            config = build()
        else:  # tests/models.py's shape of the family, with this tokenizer's vocabulary
            config = TINY[family]()
            config.update(vocab)
        save_random_model(config, path, seed=1, norm_std=DRAWN_NORMS.get(family, 0.0))
        tok.save_pretrained(path)
    return path


@dataclass
class Setup:
    """One configuration's model, loaded once, and its reference records."""

    config: Config
    base: LLM
    adapters: list[LoRARequest]
    reference: dict[str, str] = dataclasses.field(default_factory=dict)

    def llm(self, **engine) -> LLM:
        """An `LLM` over the loaded model with other engine settings (nothing loaded again)."""
        view = LLM.__new__(LLM)
        first = self.base.engine
        view.engine = LLMEngine(first.loaded, dataclasses.replace(first.config, **engine))
        for adapter in self.adapters:
            view.engine.add_lora(adapter)
        return view

    def run(self, lines: list[Line], llm: LLM | None = None) -> dict[str, str]:
        """Each line's record, by key, from one `generate` call over all of them."""
        llm = llm or self.llm()
        adapter = self.adapters[0] if self.adapters else None
        outs = llm.generate(
            [{"prompt_token_ids": line.prompt} for line in lines],
            [line.params for line in lines],
            use_tqdm=False,
            lora_request=[adapter if line.lora else None for line in lines],
        )
        return {
            line.key: golden.record(out) for line, out in zip(lines, outs, strict=True)
        }  # raises on errors

    def check(self, got: dict[str, str], keys: list[str] | None = None) -> None:
        for key in [line.key for line in LINES] if keys is None else keys:
            assert got[key] == self.reference[key], f"line {key!r} differs from the reference"


def load(config: Config, text_model: Path, root: Path) -> LLM:
    """The configuration's `LLM` (its default engine: a roomy pool, prefix caching on)."""
    path = build_model(config.family, text_model, root)
    if config.gguf:
        from gguf_models import save_gguf

        out = root / f"{config.family}-{config.gguf}.gguf"
        if not out.exists():
            save_gguf(path, out, lambda name: config.gguf)
        path = out
    lora = {"enable_lora": True, "max_loras": 2} if config.lora else {}
    return LLM(
        str(path),
        device="cpu",
        dtype=config.dtype,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        num_blocks=256,
        block_size=BLOCK,
        **lora,
    )


def make_setup(name: str, text_model: Path, root: Path) -> Setup:
    """Configuration ``name`` loaded (its models and adapters saved under ``root`` first, once), and
    its reference run."""
    config = CONFIGS[name]
    adapters = []
    if config.lora:
        adapters = [
            LoRARequest(
                adapter, i + 1, str(save_lora(text_model, root / "repro-loras", adapter, 4, seed=i + 1))
            )
            for i, adapter in enumerate(("own", "other"))
        ]
    setup = Setup(config, load(config, text_model, root), adapters)
    setup.reference = setup.run(LINES)
    return setup


@pytest.fixture(scope="module")
def setups(text_model, model_root):
    """``setups(name)``: the configuration loaded and its reference run, made once per module."""
    made: dict[str, Setup] = {}

    def get(name: str) -> Setup:
        if name not in made:
            made[name] = make_setup(name, text_model, model_root)
        return made[name]

    return get


# -- the clauses -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_each_line_alone(setups, name):
    """Other lines: each line run alone gives its record in the batch."""
    setup = setups(name)
    for line in LINES:
        setup.check(setup.run([line]), [line.key])


@pytest.mark.parametrize("name", CONFIGS)
def test_other_lines_and_their_order(setups, name):
    """The lines reversed, among more lines (the same prompts under other seeds and n)."""
    setup = setups(name)
    more = [Line(f"more-{i}", line.prompt, sampled(i + 1, 90 + i)) for i, line in enumerate(LINES)]
    mixed = [x for pair in zip(more, reversed(LINES), strict=True) for x in pair]
    setup.check(setup.run(mixed))


@pytest.mark.parametrize("name", CONFIGS)
def test_constraints_on_other_lines(setups, name):
    """Logit biases, allowed tokens, penalties, min_tokens, bad words and grammars on other lines."""
    setup = setups(name)
    setup.check(setup.run(neighbours(setup.base.tokenizer is not None) + LINES))


@pytest.mark.parametrize("name", LORA_CONFIGS)
def test_adapters_of_other_lines(setups, name):
    """Other lines with another adapter, and with the line's own adapter (its rows grow in each step)."""
    setup = setups(name)
    own, other = setup.adapters
    lines = [
        *LINES,
        Line("own-again", SHORT, sampled(3, 41), lora=True),
        Line("own-more", FIRST, sampled(2, 42), lora=True),
    ]
    llm = setup.llm()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in (OTHER, SHARED)]
        + [{"prompt_token_ids": line.prompt} for line in lines],
        [SamplingParams(**sampled(2, 43)), SamplingParams(**sampled(1, 44))]
        + [line.params for line in lines],
        use_tqdm=False,
        lora_request=[other, other] + [own if line.lora else None for line in lines],
    )
    setup.check({line.key: golden.record(out) for line, out in zip(lines, outs[2:], strict=True)})


@pytest.mark.parametrize("name", CONFIGS)
def test_max_num_seqs(setups, name):
    setup = setups(name)
    setup.check(setup.run(LINES, setup.llm(max_num_seqs=3)))


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_chunks(setups, name):
    """max_num_batched_tokens 5: prompts in chunks of up to 5 tokens, beside other lines' decodes."""
    setup = setups(name)
    setup.check(setup.run(LINES, setup.llm(max_num_batched_tokens=5)))


@pytest.mark.parametrize("name", CONFIGS)
def test_small_pool_with_preemptions(setups, name):
    setup = setups(name)
    llm = setup.llm(num_blocks=6)
    setup.check(setup.run(LINES, llm))
    assert llm.stats.preemptions > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_block_size(setups, name):
    """Blocks of 2 and of 32 tokens: other block tables, other shared and copied blocks, and a context
    cut into pieces of other lengths (2-row pieces: no 8 rows of K ever finished together)."""
    setup = setups(name)
    for size in (2, 32):
        setup.check(setup.run(LINES, setup.llm(block_size=size, num_blocks=4096 // size)))


@pytest.mark.parametrize("name", CONFIGS)
def test_prefix_caching_off(setups, name):
    setup = setups(name)
    setup.check(setup.run(LINES, setup.llm(enable_prefix_caching=False)))


@pytest.mark.parametrize("name", CONFIGS)
def test_prefix_cache_hits(setups, name):
    """The lines again on a warm engine: their prompts' full blocks come from the cache."""
    setup = setups(name)
    llm = setup.llm()
    setup.run(LINES, llm)
    setup.check(setup.run(LINES, llm))
    assert llm.stats.prefix_cache_hits >= 2 * BLOCK  # the full blocks of FIRST and SHARED


@pytest.mark.parametrize("name", CONFIGS)
def test_n_siblings(setups, name):
    """Completion i of a line is the same with fewer or more siblings (n = 1, n + 2)."""
    setup = setups(name)
    for extra in (None, 2):
        lines = [
            dataclasses.replace(
                line, fields={**line.fields, "n": 1 if extra is None else line.fields["n"] + extra}
            )
            for line in LINES
        ]
        got = setup.run(lines)
        for line in LINES:
            want, have = json.loads(setup.reference[line.key]), json.loads(got[line.key])
            keep = min(len(want["outputs"]), len(have["outputs"]))
            assert have["prompt_logprobs"] == want["prompt_logprobs"], line.key
            assert have["outputs"][:keep] == want["outputs"][:keep], line.key


@pytest.mark.parametrize("name", CONFIGS)
def test_thread_count(setups, name):
    """One thread against the suite's two (the C kernels split rows, columns and sequences by thread)."""
    setup = setups(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        setup.check(setup.run(LINES))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", LORA_CONFIGS)
def test_lora_line_beside_its_own_adapter_in_prompt_chunks(setups, name):
    """A line with an adapter, beside another line of the same adapter, in prompt chunks of 5 tokens and
    on one thread: its adapter's rows in each step differ in number from the reference's every way."""
    setup = setups(name)
    keys = [line.key for line in LINES if line.lora]
    more = [*LINES, Line("own-again", FIRST, sampled(3, 41), lora=True)]
    setup.check(setup.run(more, setup.llm(max_num_batched_tokens=5)), keys)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        setup.check(setup.run(more, setup.llm(max_num_batched_tokens=7)), keys)
    finally:
        torch.set_num_threads(threads)


# -- the command line: --resume and --data-parallel ---------------------------------------------------
def cli(*args) -> object:
    from typer.testing import CliRunner

    from pagedinfer.cli.app import app

    result = CliRunner().invoke(app, ["run", *map(str, args), "--device", "cpu", "--quiet"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def job(text_model, tmp_path_factory) -> tuple[Path, bytes]:
    """The lines and their neighbours as a batch file, and the records of one uninterrupted run."""
    root = tmp_path_factory.mktemp("repro-job")
    path = root / "lines.jsonl"
    path.write_text("".join(json.dumps(line.json()) + "\n" for line in LINES + neighbours(True)))
    out = root / "whole.jsonl"
    assert cli(path, "--model", text_model, "-o", out).exit_code == 0
    return path, out.read_bytes()


def test_resume_after_a_stop(job, text_model, tmp_path, monkeypatch):
    """A run stopped once its first line is written, resumed with other batch settings: the same bytes."""
    from pagedinfer.engine.loop import GenerationLoop

    path, whole = job
    out = tmp_path / "out.jsonl"
    original = GenerationLoop.stream

    def stopped(self, feed, max_pending=None):
        for k, item in enumerate(original(self, feed, max_pending)):
            if k == 0:
                os.kill(os.getpid(), signal.SIGINT)  # the run finishes its step and stops
            yield item

    with monkeypatch.context() as m:
        m.setattr(GenerationLoop, "stream", stopped)
        first = cli(path, "--model", text_model, "-o", out)
    assert first.exit_code == 130, first.output
    kept = out.read_bytes().count(b"\n")
    assert 0 < kept < len(whole.splitlines())
    resumed = cli(path, "--model", text_model, "-o", out, "--resume", "--max-num-seqs", 3, "--num-blocks", 8)
    assert resumed.exit_code == 0, resumed.output
    assert out.read_bytes() == whole


def test_data_parallel(job, text_model, tmp_path, monkeypatch):
    """Two local replicas on Ray (each line runs in one of them, beside other lines): the same bytes."""
    path, whole = job
    ray_tmp = Path(__import__("tempfile").mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths are short
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "dp.jsonl"
    try:
        result = cli(path, "--model", text_model, "-o", out, "--data-parallel", 2)
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == whole


# -- the instruction set ------------------------------------------------------------------------------
# a process of an AVX2 machine, as far as it can be had on an AVX-512 one: the C kernels built without
# AVX-512 (PAGEDINFER_CC_FLAGS; cached apart, by flags), torch's own kernels, oneDNN's and MKL's at AVX2
AVX2 = {
    "PAGEDINFER_CC_FLAGS": "-mno-avx512f",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# what a difference in these fingerprint components explains (docs/reproducibility.md)
EXPLAINED = {
    "libraries": "other versions of torch, transformers or tokenizers (the contract holds within one set)",
}


def records_elsewhere(args: str) -> None:
    """In a subprocess: each configuration's reference records and fingerprint components, as JSON."""
    from pagedinfer.engine.fingerprint import components

    text_model, root, out = (Path(p) for p in json.loads(args))
    found = {}
    for name in CONFIGS:
        setup = make_setup(name, text_model, root)
        found[name] = {"records": setup.reference, "components": components(setup.base.engine)}
    found["golden"] = {case: golden.run_case(case, out.parent) for case in golden.CASES}
    out.write_text(json.dumps(found))


@pytest.fixture(scope="module")
def avx2_process(setups, text_model, model_root, tmp_path_factory) -> dict:
    from pagedinfer.kernels.build import cpu_flags

    if not cpu_flags(("avx512f",)):
        pytest.skip("needs an AVX-512 CPU: its native build is what the AVX2 build is compared with")
    for name in CONFIGS:
        setups(name)  # models and adapters saved, references made
    out = tmp_path_factory.mktemp("avx2") / "records.json"
    code = f"import test_reproducibility as t; t.records_elsewhere({json.dumps(json.dumps([str(text_model), str(model_root), str(out)]))})"
    env = {**os.environ, **AVX2, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def explain(differing: list[str], here: dict, there: dict, ignore: tuple[str, ...] = ()) -> None:
    """Records of ``differing`` lines differ between two runs with fingerprint components ``here`` and
    ``there``: an expected failure when the components show other versions of the libraries (the
    contract holds within one set), else a failure (also when the fingerprints agree: they promise the
    same bytes)."""
    changed = sorted(k for k in here if k not in ignore and here[k] != there.get(k))
    assert changed, f"lines {differing} differ, yet the fingerprints agree"
    unexplained = {k: (here[k], there.get(k)) for k in changed if k not in EXPLAINED}
    assert not unexplained, f"lines {differing} differ with fingerprint components {unexplained}"
    pytest.xfail(f"lines {differing} differ: {'; '.join(EXPLAINED[k] for k in changed)}")


@pytest.mark.parametrize("name", CONFIGS)
def test_instruction_set(setups, avx2_process, name):
    """The same lines in the AVX2 process (the kernels built without AVX-512, so bfloat16's pair products
    emulated; torch, oneDNN and MKL held to AVX2): the same bytes, and the same fingerprint."""
    from pagedinfer.engine.fingerprint import components

    setup = setups(name)
    other = avx2_process[name]
    assert json.loads(json.dumps(components(setup.base.engine))) == other["components"]
    differing = [key for key in setup.reference if other["records"][key] != setup.reference[key]]
    assert not differing, f"lines {differing} differ in the AVX2 process"


# what MKL computes for torch: its VML functions (float32 exp, log, tanh, sqrt, erf, atan, sin, cos) and a
# BLAS product, as hashes, with the code path it took, after `import pagedinfer` (which asks for one path)
MKL_PROBE = """
import hashlib, json, torch
import pagedinfer
from pagedinfer.engine.fingerprint import mkl_branch
x = ((torch.arange(4099, dtype=torch.float64) * 0.6180339887) % 1 * 40 - 20).float()  # [4099] in [-20, 20)
a = x.abs() + 0.01  # [4099] > 0
ops = dict(exp=x.exp(), log=a.log(), tanh=x.tanh(), sqrt=a.sqrt(), erf=(x / 8).erf(), atan=x.atan(),
           sin=x.sin(), cos=x.cos(), mm=x[:4096].view(64, 64) @ x[:4096].view(64, 64).T)  # mm: [64, 64]
print(json.dumps({"branch": mkl_branch(), **{k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in ops.items()}}))
"""


def mkl_probe(**env: str) -> dict:
    """`MKL_PROBE`'s answer in a process with ``env``, and no MKL_CBWR but what ``env`` sets."""
    inherited = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # this process's import set it
    run = subprocess.run(
        [sys.executable, "-c", MKL_PROBE],
        env={**inherited, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_mkl_takes_one_code_path_on_every_cpu():
    """MKL's code path follows the CPU (an Intel CPU's AVX-512 exp and log round otherwise than the
    path an AMD CPU takes): under pagedinfer it takes one path, its COMPATIBLE branch, whatever MKL is
    allowed to use, so its results have the same bits for every instruction set MKL could pick."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch is built without MKL")
    native = mkl_probe()
    assert native["branch"] == "COMPATIBLE"
    for isa in ("SSE4_2", "AVX2", "AVX512"):
        assert mkl_probe(MKL_ENABLE_INSTRUCTIONS=isa) == native, f"MKL's results differ when held to {isa}"
    assert mkl_probe(MKL_CBWR="AUTO")["branch"] == "the CPU's"  # a value already set wins, and is told


# -- golden records: the same bits on every machine ----------------------------------------------------
def check_golden(case: str, found: dict) -> None:
    """``found`` (`make_golden.run_case`'s) against tests/golden/: bit for bit, or a difference the
    fingerprint explains."""
    kept = json.loads(golden.MANIFEST.read_text())["cases"][case]
    if kept["weights"] is not None:  # generated here: the same weights first, then the same numerics
        assert found["weights"] == kept["weights"], "the portable weights came out other bits here"
    want = golden.read_golden(case)
    differing = [key for key in want if found["records"][key] != want[key]]
    if differing:  # a generated model's files may be written otherwise: its weights were checked above
        explain(
            differing, found["components"], kept["components"], ignore=("model",) if kept["weights"] else ()
        )


@pytest.mark.parametrize("case", list(golden.CASES))
def test_golden_records(case, tmp_path):
    """Each case's records on this machine equal tests/golden/'s bit for bit (scripts/make_golden.py made
    them), or differ only where the fingerprint shows other versions of the libraries."""
    check_golden(case, golden.run_case(case, tmp_path))


@pytest.mark.parametrize("case", list(golden.CASES))
def test_golden_records_in_the_avx2_process(case, avx2_process):
    """The same in the AVX2 process: what an AVX2 machine computes, on this one."""
    check_golden(case, avx2_process["golden"][case])


# -- the fingerprint and the report ---------------------------------------------------------------------
def test_system_fingerprint_names_what_decides_the_bytes(setups, tmp_path, monkeypatch):
    """The same under every setting the contract says changes nothing; another for another dtype,
    quantization, KV dtype, model content (not path), adapter or numerics version."""
    from pagedinfer.engine import fingerprint

    setup = setups("qwen3-float32")
    base = setup.base.engine.system_fingerprint()
    assert base.startswith("fp_") and len(base) == 19
    same = setup.llm(max_num_seqs=3, max_num_batched_tokens=5, num_blocks=6, enable_prefix_caching=False)
    assert same.engine.system_fingerprint() == base
    others = {setups(name).base.engine.system_fingerprint() for name in ("qwen3-bfloat16", "qwen3-int8")}
    others.add(setup.llm(kv_cache_dtype="bfloat16").engine.system_fingerprint())
    assert len(others | {base}) == 4
    lora = setups("llama-float32").llm().engine  # its adapters loaded
    assert lora.system_fingerprint("own") not in (lora.system_fingerprint(), lora.system_fingerprint("other"))
    model = Path(setup.base.engine.loaded.name)
    copy = shutil.copytree(model, tmp_path / "copy")
    assert LLM(str(copy), device="cpu", num_blocks=8).engine.system_fingerprint() == base  # content, not path
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert LLM(str(copy), device="cpu", num_blocks=8).engine.system_fingerprint() != base
    monkeypatch.setattr(fingerprint, "NUMERICS_VERSION", fingerprint.NUMERICS_VERSION + 1)
    assert setup.llm().engine.system_fingerprint() != base


def test_reproducible_says_whether_the_path_is_covered(setups, tiny_model, monkeypatch):
    from pagedinfer.engine import fingerprint as fp
    from pagedinfer.kernels import paged_decode
    from pagedinfer.lora import delta

    engine = setups("qwen3-float32").llm().engine
    assert engine.stats.to_dict()["reproducibility"]["system_fingerprint"] == ""  # not asked for yet
    fingerprint = engine.system_fingerprint()
    assert engine.stats.to_dict()["reproducibility"] == {
        "covered": True,
        "why": "own layers and C kernels on the CPU",
        "system_fingerprint": fingerprint,
    }
    lora = setups("llama-float32").base.engine.stats.reproducibility
    assert lora.words() == "yes: own layers and C kernels on the CPU"  # the deltas in cpu_lora.c
    in_c = setups("llama-float32").llm().engine.system_fingerprint("own")
    with monkeypatch.context() as m:
        m.setattr(delta, "library", lambda: None)  # the deltas' kernel did not build: torch's GEMMs
        on_torch = setups("llama-float32").llm().engine
        assert on_torch.stats.reproducibility.words() == (
            "yes: own layers and C kernels on the CPU; lines with a LoRA adapter excepted (deltas on torch)"
        )
        assert on_torch.system_fingerprint("own") != in_c
        assert on_torch.system_fingerprint() == setups("llama-float32").base.engine.system_fingerprint()
    with monkeypatch.context() as m:
        m.setattr(fp, "mkl_branch", lambda: "the CPU's")  # MKL_CBWR set otherwise, or MKL ran first
        elsewhere = setups("qwen3-float32").llm().engine
        assert elsewhere.stats.reproducibility.words().startswith("no: MKL (the sampler's exp and logsumexp)")
        assert elsewhere.system_fingerprint() != fingerprint

    def verdict(family: str, **kwargs) -> str:
        llm = LLM(str(tiny_model(family)), device="cpu", dtype="float32", num_blocks=8, **kwargs)
        return llm.stats.reproducibility.words()

    assert (
        verdict("qwen2", model_impl="transformers") == "no: transformers' qwen2 layers (outside the contract)"
    )
    assert verdict("gpt2") == (
        "no: transformers' gpt2 layers (outside the contract); its matrices on torch (Conv1D) vary with the batch"
    )
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "onednn")
    assert (
        verdict("llama") == "no: linears on torch (GatedLinear, Linear), not the C panels"
    )  # small for oneDNN
    monkeypatch.setattr(paged_decode, "available", lambda *dtypes: False)  # no compiler, say
    assert verdict("llama") == "no: attention runs on torch's path (no C kernel for this pool or shape)"


def test_fingerprint_in_records_report_and_resume_file(job, text_model, tmp_path, monkeypatch):
    """OpenAI bodies, --report-json and the .resume file carry the run's fingerprint; a resume under
    another one keeps going and says so."""
    path = tmp_path / "openai.jsonl"
    bodies = [{"prompt": "To be", "max_tokens": 3, "seed": 1, "n": 2}, {"prompt": "or not", "max_tokens": 2}]
    path.write_text(
        "".join(
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
            + "\n"
            for i, body in enumerate(bodies)
        )
    )
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    assert cli(path, "--model", text_model, "-o", out, "--report-json", report).exit_code == 0
    want = LLM(str(text_model), device="cpu", num_blocks=8).engine.system_fingerprint()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["response"]["body"]["system_fingerprint"] for r in records] == [want, want]
    assert json.loads(report.read_text())["reproducibility"]["system_fingerprint"] == want
    resume_file = out.with_name(out.name + ".resume")
    assert json.loads(resume_file.read_bytes()[:512])["system_fingerprint"] == want
    out.write_text(out.read_text().splitlines(keepends=True)[0])  # the second line to run again
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "onednn")  # another path: another fingerprint
    result = cli(path, "--model", text_model, "-o", out, "--resume")
    assert result.exit_code == 0, result.output
    assert f"were made under system_fingerprint {want}, this run's is fp_" in " ".join(result.stderr.split())
    assert json.loads(resume_file.read_bytes()[:512])["system_fingerprint"] != want


@pytest.mark.parametrize("name", ["qwen3-float32", "llama-bfloat16"])
def test_beam_search_lines(setups, name):
    """A beam-search line: its beams (tokens, cumulative logprobs, scores) alone, among sampled lines, in
    prompt chunks of 5 and in a preempting pool."""
    from pagedinfer import BeamSearchParams

    setup = setups(name)
    beams = BeamSearchParams(beam_width=3, max_tokens=6)

    def beam_record(llm: LLM, others: list[Line]) -> str:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in [FIRST] + [line.prompt for line in others]],
            [beams] + [line.params for line in others],
            use_tqdm=False,
        )
        assert outs[0].error is None, outs[0].error
        return json.dumps(
            [[s.token_ids, s.cumulative_logprob, s.score, s.finish_reason] for s in outs[0].sequences]
        )

    alone = beam_record(setup.llm(), [])
    base = [line for line in LINES if not line.lora]
    assert beam_record(setup.llm(), base) == alone
    assert beam_record(setup.llm(max_num_batched_tokens=5), base) == alone
    small = setup.llm(num_blocks=6)
    assert beam_record(small, base) == alone
    assert small.stats.preemptions > 0
