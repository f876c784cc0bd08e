"""Untrusted grammars (decoding/grammar.py's Limits and Sandbox): refused by size and rules before they compile; a
grammar that crashes the compiler or runs past the time budget costs the child process only; a matcher that fails
mid-answer, or whose masks pass their CPU budget, ends its own row with its own error while the rows beside it go
on to the answers they have alone. Each was run against the code before these bounds and failed there: the chained
grammar killed the test process (exit 139), the budget was never met, and the failing matcher raised out of the
round, ending the victim's row too."""
from __future__ import annotations

import time

import pytest

from specrt.decoding.grammar import LIMITS, Limits, Matcher, compile_grammar, library
from specrt.decoding.processors import Penalties
from specrt.errors import InputError

A = 81   # "a" in SmolLM2's tokenizer
# every "a" makes the Earley rows of this ambiguous grammar grow: llguidance refuses after 13 of them ("Current row
# has 2103 items; max is 2000") and its masks take 25 ms to over a second a token on the way
NESTED = ("start: s\ns: " + " | ".join(f"r{i}" for i in range(50)) + ' | "a"\n'
          + "".join(f'r{i}: s s | "a"\n' for i in range(50)))


def chain(n: int) -> str:
    """n chained rules with distinct literals: llguidance 1.9.1 overflows an 8 MiB stack compiling 3,000."""
    return "start: r0\n" + "".join(f'r{i}: "k{i}" r{i + 1} | "z"\n' for i in range(n)) + f'r{n}: "end"\n'


@pytest.fixture(scope="module")
def tok(default_engines):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_engines / "tokenizer")
    library(tok)
    return tok


def test_sizes_and_rules_are_refused_before_compiling(tok):
    started = time.perf_counter()
    with pytest.raises(InputError, match="2,002 rules: the most this server compiles is 1,000"):
        compile_grammar(tok, "grammar", chain(2000), isolated=True)
    big = "start: " + " | ".join(f'"x{i}"' for i in range(20_000))   # 209 KB: 3.6 s to compile at 500 KB
    with pytest.raises(InputError, match="208,894 characters: the most this server compiles is 131,072"):
        compile_grammar(tok, "grammar", big, isolated=True)
    schema = {"enum": [f"value number {i}" for i in range(10_000)]}
    with pytest.raises(InputError, match=r"json_schema of .* characters \(as compact JSON\)"):
        compile_grammar(tok, "json_schema", schema)   # the bounds hold in-process too
    assert time.perf_counter() - started < 1.0


def test_a_crash_or_a_runaway_ends_the_child_alone(tok):
    """The issue's 3,000 chained rules on the 8 MiB stack that crashed the server: the child dies (SIGSEGV), the
    request is refused, the next grammar compiles in a new child; on the default 64 MiB stack it compiles."""
    with pytest.raises(InputError, match=r"crashed the grammar compiler \(exit code -11\)"):
        compile_grammar(tok, "grammar", chain(3000), isolated=True, limits=Limits(max_rules=10_000,
                                                                                  stack_bytes=8 << 20))
    yes = Matcher(compile_grammar(tok, "grammar", 'start: "yes" | "no"', isolated=True))
    assert yes.advance(tok("yes")["input_ids"]) == 1 and yes.done
    compile_grammar(tok, "grammar", chain(3000), isolated=True, limits=Limits(max_rules=10_000))
    slow = "start: " + " | ".join(f'"x{i}"' for i in range(12_000))
    started = time.perf_counter()
    with pytest.raises(InputError, match="took longer than 0.1 s"):
        compile_grammar(tok, "grammar", slow, isolated=True, limits=Limits(compile_s=0.1))
    assert time.perf_counter() - started < 1.0


def test_the_cache_is_bounded_by_its_grammars_text(tok):
    limits = Limits(cache_chars=3000)
    grammars = [compile_grammar(tok, "regex", f"({i}|{'x' * 1000})+", limits=limits) for i in range(4)]
    assert compile_grammar(tok, "regex", f"(3|{'x' * 1000})+", limits=limits) is grammars[3]
    assert compile_grammar(tok, "regex", f"(0|{'x' * 1000})+", limits=limits) is not grammars[0]   # dropped
    cache = library(tok).cache
    assert sum(len(key[1]) for key in cache if key[2] == limits) <= 3000


def test_a_failing_matcher_raises_nothing_and_allows_only_the_end(tok):
    m = Matcher(compile_grammar(tok, "grammar", NESTED, limits=Limits(mask_burst_s=1e9)))   # the library's limit
    for n in range(40):
        if m.commit([A]) != 1:
            break
    assert 5 < n < 20 and "max is 2000" in str(m.error), (n, m.error)
    assert m.done and m.allowed().nonzero()[0].tolist() == [2] and len(str(m.error)) < 600
    budget = Matcher(compile_grammar(tok, "grammar", NESTED, limits=Limits(mask_burst_s=0.05, mask_per_token_s=0)))
    while budget.error is None:
        budget.commit([A])
    assert "CPU time" in str(budget.error) and budget.mask_s > 0.05, budget.error
    assert LIMITS.mask_burst_s == 0.5   # the default: a JSON schema's masks take 0.07 ms a token here


def test_a_failing_grammar_ends_its_own_row_alone(default_generator):
    """A batch of a victim and a row whose grammar fails after a few tokens (logit_bias makes it write "a"), EAGLE's
    trees (a mask at every node): the victim's tokens are its answer alone; the other row ends with its own error
    (stop reason grammar_error), and generate() raises it."""
    gen, method = default_generator, "eagle"
    victim = gen.encode("Name three rivers.")
    alone = gen.generate(prompt_ids=victim, max_new_tokens=24, method=method).token_ids[0]
    hostile, bias = gen.grammar("grammar", NESTED, isolated=True), Penalties(logit_bias=((A, 100.0),))
    batch, out = gen.batch(2, method=method), {}
    batch.add(victim, 24, owner="victim")
    batch.add(gen.encode("Say a."), 24, owner="hostile", grammar=hostile, penalties=bias)
    while batch.run.batch:
        batch.step()
        out |= {row.owner: (row, tokens) for row, tokens in batch.retire()}
    assert out["victim"][1] == alone
    row = out["hostile"][0]
    assert row.stop_reason == "grammar_error" and "a token: simplify" in str(row.matcher.error)   # its masks' CPU
    with pytest.raises(InputError, match="a token: simplify the grammar"):
        gen.generate("Say a.", max_new_tokens=24, method=method, grammar=hostile, logit_bias={A: 100.0})
