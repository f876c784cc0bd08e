"""`specrt verify`'s options and verdicts: a bad --samples or --alpha is refused by name, and a verify that ran no
chi-square test is NOT TESTED (exit status 3), never PASS."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import export_tiny
from specrt.cli import main


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("verify"), "llama", max_seq_len=32)[0]


def verify(directory, *args):
    return CliRunner().invoke(main, ["verify", str(directory), "--method", "ngram", "--prompts", "1",
                                     "--max-new-tokens", "6", "--depth", "2", "--temperature", "1.0", "--top-k", "2",
                                     *args])


@pytest.mark.parametrize("args, named", [
    (["--samples", "-1"], "--samples"),   # drew nothing and said PASS
    (["--alpha", "-1"], "--alpha"),       # no p-value is at or below it: could never fail
    (["--alpha", "0"], "--alpha"),
    (["--alpha", "1.5"], "--alpha"),      # every p-value is: could never pass
])
def test_verify_refuses_a_bad_samples_or_alpha(engines, args, named):
    out = verify(engines, "--samples", "400", *args)
    assert out.exit_code == 2, out.output
    assert named in out.output and args[1] in out.output and "PASS" not in out.output


def test_verify_without_a_sampling_test_is_not_tested(engines):
    """--samples 0 skips the sampling check: the greedy check alone cannot PASS the promise."""
    out = verify(engines, "--samples", "0")
    assert "identical" in out.output   # the greedy check ran (and found nothing)
    assert out.exit_code == 3, out.output
    assert "NOT TESTED" in out.output and "PASS" not in out.output
    assert "could not test: sampling: --samples 0" in out.output


def test_sampling_batches_shrink_with_the_vocabulary():
    """verify's sampling draws 256 sequences a batch for SmolLM2's 49,152 ids, fewer for Gemma 3's 262,144 (whose
    batches of 256 took 22 GB with rest's trees), never fewer than 8."""
    from specrt.measurement.check import chunk_for
    assert (chunk_for(128), chunk_for(49152), chunk_for(262144), chunk_for(10**8)) == (256, 256, 64, 8)
