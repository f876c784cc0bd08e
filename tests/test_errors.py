"""Bad input: a clear error that names the value, and nothing half-written on disk."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from conftest import tiny_model
from specrt.errors import InputError, ManifestError, UnknownSourceError
from specrt.export.pipeline import export_engines
from specrt.decoding.generate import Generator


def test_prompt_longer_than_engine(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])  # max_seq_len 64
    with pytest.raises(InputError, match=r"prompt of 64 tokens .* maximum sequence length 64"):
        gen.generate(prompt_ids=[1] * 64, method="autoregressive")


def test_generation_reaching_max_len_stops_cleanly(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    for method in ("autoregressive", "ngram"):
        out = gen.generate(prompt_ids=[1, 2, 3] * 20, max_new_tokens=50, method=method)
        assert out.stats["stop_reason"] == "max_seq_len"
        assert len(out.token_ids[0]) == 64 - 60
    # the next request on the same generator is unaffected
    assert len(gen.generate(prompt_ids=[1, 2], max_new_tokens=10, method="autoregressive").token_ids[0]) == 10


def test_export_caps_max_seq_len_at_the_models_positions(tmp_path):
    """A tiny model knows 256 positions: a request for 400 is capped (and said so), and a prompt past 256 is refused
    instead of generating at positions the model never saw."""
    tiny_model("llama", 0).save_pretrained(tmp_path / "src")
    said = []
    export_engines(str(tmp_path / "src"), tmp_path / "e", max_seq_len=400, log=said.append)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["models"]["target"]["max_seq_len"] == 256
    assert any("--max-seq-len 400" in s and "max_position_embeddings (256)" in s for s in said)
    from specrt.export.build import build
    build(tmp_path / "e", "onnxruntime", log=lambda *_: None)
    with pytest.raises(InputError, match="prompt of 300 tokens"):
        Generator.from_engines(tmp_path / "e").generate(prompt_ids=[1] * 300, method="autoregressive")


@pytest.mark.parametrize("kw, pattern", [
    (dict(temperature=-0.5), "temperature -0.5"),
    (dict(temperature=1e300), "temperature 1e.300: at most 100"),   # 1 / T is 0 in float32: NaN under a mask
    (dict(temperature=float("nan")), "temperature nan"),
    (dict(temperature=1.0, top_p=0.0), "top_p 0.0"),
    (dict(temperature=1.0, top_p=1.5), "top_p 1.5"),
    (dict(temperature=1.0, top_k=-1), "top_k -1"),
    (dict(method="beam"), "method 'beam'"),
    (dict(method="draft"), "no draft model"),
    (dict(max_new_tokens=0), "max_new_tokens 0"),
])
def test_invalid_parameters(tiny_engines, kw, pattern):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    with pytest.raises(InputError, match=pattern):
        gen.generate(prompt_ids=[1, 2], **kw)


def test_out_of_vocab_prompt_ids(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    with pytest.raises(InputError, match=r"\[999\]"):
        gen.generate(prompt_ids=[1, 999], method="autoregressive")


def test_unknown_source_leaves_nothing(tmp_path):
    out = tmp_path / "e"
    with pytest.raises(UnknownSourceError, match="'no-such-model'"):
        export_engines("no-such-model", out)
    assert list(tmp_path.iterdir()) == []


def test_failed_export_half_way_leaves_nothing(tmp_path):
    """The target graph is written, then the draft is refused (vocab differs): no engine directory remains."""
    tiny_model("llama").save_pretrained(tmp_path / "t")
    tiny_model("llama", vocab=48).save_pretrained(tmp_path / "d")
    with pytest.raises(ManifestError, match="vocab size 48.*has 64"):
        export_engines(str(tmp_path / "t"), tmp_path / "e", draft=str(tmp_path / "d"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t"]


# The export of the interrupt test, stopped inside the staging directory once its target graph is written: it says
# so on stdout and waits there for the test's Ctrl-C (no guess of how long an export takes on a loaded machine).
STOPS_IN_STAGING = """
import signal, sys
import specrt.export.pipeline as pipeline
from specrt.cli import main
traced = pipeline.export_graph
def export_graph(*args, **kw):
    traced(*args, **kw)
    print("in staging", flush=True)
    signal.pause()   # until SIGINT
pipeline.export_graph = export_graph
main(["export", "--target", sys.argv[1], "--out", sys.argv[2]])
"""


def test_interrupted_export_leaves_nothing(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "t")
    # Ctrl-C as in a terminal: a process started in the background by a non-interactive shell (as CI runners may
    # start this suite) inherits SIGINT ignored, or blocked, and Python then never turns SIGINT into
    # KeyboardInterrupt (a blocked one stays pending and the export ends with 0).
    def as_in_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-c", STOPS_IN_STAGING, str(tmp_path / "t"), str(tmp_path / "e")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)
    said = proc.stdout.readline()   # blocks until the export is in its staging directory, or has ended
    assert said == "in staging\n", f"the export ended before it could be interrupted: {proc.communicate()[1][-2000:]}"
    assert any(p.name.startswith(".e.partial") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)   # a bound on a hang only: it ends at once
    assert proc.returncode != 0, f"the export ran to its end after SIGINT: {err[-2000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_an_interrupt_swallowed_mid_export_still_stops_it(tmp_path):
    """A KeyboardInterrupt raised inside a destructor is printed and dropped by Python; the staging directory
    still sees the Ctrl-C, removes itself and does not move into place."""
    from specrt.files import StagingDir
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with StagingDir(tmp_path / "e", force=False) as tmp:
                (tmp / "manifest.json").write_text("{}")
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass  # what happens to it in a __del__
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force(tiny_engines):
    with pytest.raises(InputError, match="--force"):
        export_engines("smollm2-135m", tiny_engines["llama"][0])


def test_force_replaces_only_an_engine_set(tmp_path):
    """--force on a folder that is not an engine set (no manifest.json) or on a file is refused before anything is
    written, and the folder is left as it was; an engine set or an empty folder is replaced."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for out in (mine, tmp_path / "file"):
        with pytest.raises(InputError, match=f"--out {out} is .*--force replaces only an engine set"):
            export_engines("smollm2-135m", out, force=True)
    assert (mine / "sub" / "notes.txt").read_text() == "keep me" and (tmp_path / "file").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]   # no staging directory either
    tiny_model("llama").save_pretrained(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "empty"):   # an empty folder, then the engine set written there
        export_engines(str(tmp_path / "src"), out, max_seq_len=16, force=True, log=lambda *_: None)
        assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("manifest", [
    {"name": "My App", "short_name": "app", "start_url": "/", "display": "standalone"},   # a web app's
    {"manifest_version": 3, "name": "An extension", "version": "1.0"},                    # a browser extension's
    {"format_version": 1, "name": "something else"},                                      # no models
    ["not", "an", "object"],
])
def test_force_refuses_a_folder_whose_manifest_is_not_specrts(tmp_path, manifest):
    """A manifest.json is not enough: --force replaces only a folder whose manifest reads as an engine set's."""
    tiny_model("llama").save_pretrained(tmp_path / "src")
    site = tmp_path / "site"
    (site / "assets").mkdir(parents=True)
    (site / "manifest.json").write_text(json.dumps(manifest))
    (site / "assets" / "index.js").write_text("keep me")
    with pytest.raises(InputError, match=f"--out {re.escape(str(site))} .*not a specrt engine set"):
        export_engines(str(tmp_path / "src"), site, max_seq_len=16, force=True, log=lambda *_: None)
    assert (site / "assets" / "index.js").read_text() == "keep me"
    assert json.loads((site / "manifest.json").read_text()) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site", "src"]   # no staging directory either


def test_staging_removes_only_what_it_made(tmp_path, capsys):
    """Folders beside --out named like a staging directory (.e.partial-*, .e.old) that this export did not make
    stay, named in a message: another export may be writing one, and a .old may hold the only copy of an engine
    set. What it made itself is gone after it succeeds, and after it fails."""
    from specrt.files import StagingDir
    out = tmp_path / "e"
    theirs = [".e.old", ".e.partial-1234"]
    for name in theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("theirs")
    for n in range(2):   # a new engine set, then one that replaces it
        with StagingDir(out, force=True) as tmp:
            (tmp / "manifest.json").write_text(str(n))
        assert (out / "manifest.json").read_text() == str(n)
    with pytest.raises(RuntimeError):
        with StagingDir(out, force=True) as tmp:
            raise RuntimeError("the export failed")
    assert (out / "manifest.json").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["e", *theirs])
    assert all((tmp_path / name / "manifest.json").read_text() == "theirs" for name in theirs)
    said = capsys.readouterr().err
    assert all(name in said for name in theirs) and "not removed" in said


def test_manifest_mismatch(tiny_engines, tmp_path):
    import shutil
    src = tiny_engines["llama"][0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with open(bad / "target.ort.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestError, match="target.ort.onnx has sha256"):
        Generator.from_engines(bad)
    (bad / "target.ort.onnx").unlink()
    with pytest.raises(ManifestError, match="missing"):
        Generator.from_engines(bad)
    with pytest.raises(ManifestError, match="no manifest.json"):
        Generator.from_engines(tmp_path)


def test_draft_vocab_mismatch_refused(tiny_engines, tmp_path):
    import shutil
    bad = tmp_path / "pair"
    shutil.copytree(tiny_engines["llama"][0], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["models"]["draft"] = dict(manifest["models"]["target"], vocab_size=32)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="draft vocab size 32 differs from target vocab size 64"):
        Generator.from_engines(bad)


def test_cli_error_is_one_clear_line(tiny_engines):
    out = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", str(tiny_engines["llama"][0]),
                          "--prompt-ids", "1,2", "--temperature", "-1"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "temperature -1.0: must be >= 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_datastore_force_refuses_a_folder_that_is_not_a_datastore(tmp_path):
    """`datastore build --force` replaces a datastore, not another program's folder with a datastore.json."""
    from specrt.decoding import datastore
    from specrt.decoding.datastore import DatastoreError
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "datastore.json").write_text(json.dumps({"name": "another tool's"}))
    (theirs / "data.bin").write_text("keep me")
    with pytest.raises(DatastoreError, match=f"{re.escape(str(theirs))} exists and is not a specrt datastore"):
        datastore.build([tmp_path / "corpus.txt"], tmp_path / "engines", theirs, force=True, progress=False)
    assert (theirs / "data.bin").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]


def test_a_manifest_that_is_not_an_object_is_named(tmp_path):
    from specrt.engines.manifest import read_manifest
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="is not a JSON object"):
        read_manifest(tmp_path)


def _gguf_header(path, alignment: bytes) -> None:
    """A GGUF file of a header alone: general.architecture and general.alignment (its type and value: `alignment`),
    no tensors."""
    import struct

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()
    kv = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    kv += string("general.alignment") + alignment
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv)


@pytest.mark.parametrize("alignment,said", [
    (b"\x04\x00\x00\x00" + (0).to_bytes(4, "little"), "general.alignment is 0"),                  # uint32 0
    (b"\x09\x00\x00\x00" + b"\x04\x00\x00\x00" + (1).to_bytes(8, "little") + (32).to_bytes(4, "little"),
     "general.alignment is array([32]"),                                                         # an array of uint32
], ids=["zero", "array"])
def test_gguf_alignment_that_is_not_a_positive_integer(tmp_path, alignment, said):
    """The header's alignment divides the data's start: 0 (a ZeroDivisionError) or an array (a TypeError) is the
    reader's own error, naming the key and the fix."""
    from specrt.export.gguf_files import read_header
    path = tmp_path / "model.gguf"
    _gguf_header(path, alignment)
    with pytest.raises(UnknownSourceError, match=re.escape(said) + r".*positive integer.*write it again"):
        read_header(path)
    _gguf_header(path, b"\x04\x00\x00\x00" + (64).to_bytes(4, "little"))
    assert read_header(path).data_start == 128   # the 102-byte header, to the next multiple of 64
