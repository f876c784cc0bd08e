"""Structured output under speculation, measured: 20 JSON schemas, every method, with the grammar and without.

    python -m specrt.measurement.structured --engines ENGINES --out DIR [--max-new-tokens 160] [--speed-prompts 4]
        [--sampled-methods autoregressive,draft,eagle] [--sampled-prompts 6] [--temperature 0.7]

For each schema (SCHEMAS: a prompt that asks for such a record, and its JSON schema) and each method, greedy:
  - with the grammar (`grammar=("json_schema", schema)`): does the answer finish (stop_reason "eos", not
    "max_new_tokens"), parse (json.loads) and validate (jsonschema)? Are its tokens those of constrained
    autoregressive decoding? How many of its positions did the grammar force (one allowed token: a pass that
    forced-token skipping would save)?
  - without it, on the first --speed-prompts schemas: the same prompt unconstrained, same max_new_tokens, run right
    before or after the constrained one (the order alternates per prompt), so that both arms see the same load.
Then at --temperature (seeded: schema i with seed + i) for --sampled-methods on the first --sampled-prompts
schemas: finish, parse and validate with the grammar. Last, untimed: at how many positions of the autoregressive
answers, constrained and not, the unconstrained target's and draft model's argmax is the answer's token (where the
grammar overrides the models, a drafter that does not see the mask guesses wrong).

Speed per method and arm: decode tokens/s (new tokens after the first over the time after the prefill, summed over
the prompts: the arms' answers differ in length, so the prefill would weigh differently), end-to-end tokens/s (the
stats' figure, prefill included) and tokens per round (new tokens after the first over rounds). Prints Markdown
tables and writes DIR/structured.json (every run, then the summary; `summarize` recomputes the summary from the runs).
"""
from __future__ import annotations

import json
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path

import click
import numpy as np

METHODS = ("autoregressive", "draft", "ngram", "medusa", "eagle", "rest")
SAMPLED_METHODS = ("autoregressive", "draft", "eagle")


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


def _str(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _int(lo: int | None = None, hi: int | None = None) -> dict:
    return {"type": "integer", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}


def _num(lo: float | None = None, hi: float | None = None) -> dict:
    return {"type": "number", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}


def _enum(*values) -> dict:
    return {"enum": list(values)}


def _array(items: dict, n: int) -> dict:
    return {"type": "array", "items": items, "maxItems": n}


BOOL = {"type": "boolean"}

# name -> (prompt, schema). Strings are bounded (maxLength) and arrays too (maxItems): a small model that repeats
# itself inside a string or a list would otherwise run to max_new_tokens; fields not in "required" are optional.
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("Give a JSON record of a person with name, age and, if known, email.",
               _obj(["name", "age"], name=_str(30), age=_int(0, 120), email=_str(40))),
    "book": ("Describe a well-known novel as JSON: title, author, year, up to three genres and whether it is in "
             "print.",
             _obj(["title", "author", "year", "genres", "in_print"], title=_str(60), author=_str(40), year=_int(),
                  genres=_array(_enum("fiction", "mystery", "romance", "science fiction", "fantasy", "history"), 3),
                  in_print=BOOL)),
    "product": ("Write a product listing for a coffee mug as JSON with name, price, currency, stock and tags.",
                _obj(["name", "price", "currency", "stock"], name=_str(40), price=_num(0),
                     currency=_enum("USD", "EUR", "GBP"), stock=_int(0), tags=_array(_str(15), 4))),
    "address": ("Give a postal address for a customer as JSON: the name and a nested address with street, city, "
                "postcode and country.",
                _obj(["name", "address"], name=_str(30),
                     address=_obj(["street", "city", "postcode", "country"], street=_str(40), city=_str(30),
                                  postcode=_str(10), country=_enum("US", "UK", "FR", "DE", "JP")))),
    "weather": ("Report today's weather in a city as JSON: city, temperature in Celsius, conditions, humidity and "
                "wind (speed and direction).",
                _obj(["city", "temperature_c", "conditions", "humidity", "wind"], city=_str(30),
                     temperature_c=_num(-60, 60), conditions=_enum("sunny", "cloudy", "rain", "snow", "fog"),
                     humidity=_int(0, 100),
                     wind=_obj(["speed_kmh", "direction"], speed_kmh=_num(0, 300),
                               direction=_enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")))),
    "recipe": ("Give a simple pancake recipe as JSON: title, servings, a list of ingredients with quantities, and "
               "whether it is vegetarian.",
               _obj(["title", "servings", "ingredients", "vegetarian"], title=_str(40), servings=_int(1, 12),
                    ingredients=_array(_obj(["item", "quantity"], item=_str(30), quantity=_str(15)), 5),
                    vegetarian=BOOL)),
    "event": ("Describe a conference as a JSON event: name, date (YYYY-MM-DD), location, number of attendees and "
              "whether it is online.",
              _obj(["name", "date", "location", "attendees", "online"], name=_str(50),
                   date=_str(10, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"), location=_str(40), attendees=_int(0),
                   online=BOOL)),
    "employee": ("Create an employee record in JSON with id, name, department, optionally their manager (name and "
                 "id), and up to four skills.",
                 _obj(["id", "name", "department", "skills"], id=_int(1), name=_str(30),
                      department=_enum("engineering", "sales", "marketing", "finance", "support"),
                      manager=_obj(["name", "id"], name=_str(30), id=_int(1)), skills=_array(_str(20), 4))),
    "movie": ("Describe a famous film as JSON: title, year, a rating out of 10 and up to three cast members with "
              "their roles.",
              _obj(["title", "year", "rating", "cast"], title=_str(50), year=_int(1880, 2030), rating=_num(0, 10),
                   cast=_array(_obj(["actor", "role"], actor=_str(30), role=_str(30)), 3))),
    "todo": ("Write a to-do list as JSON: the owner and up to four tasks, each with a description, whether it is "
             "done and a priority.",
             _obj(["owner", "items"], owner=_str(30),
                  items=_array(_obj(["task", "done", "priority"], task=_str(40), done=BOOL,
                                    priority=_enum("low", "medium", "high")), 4))),
    "flight": ("Give the status of a flight as JSON: flight number, origin and destination airport codes, "
               "departure time, seats left and status.",
               _obj(["flight_number", "from", "to", "departure", "seats_left", "status"],
                    flight_number=_str(6, pattern=r"^[A-Z]{2}[0-9]{1,4}$"), **{"from": _str(3, pattern=r"^[A-Z]{3}$")},
                    to=_str(3, pattern=r"^[A-Z]{3}$"), departure=_str(25), seats_left=_int(0),
                    status=_enum("scheduled", "boarding", "delayed", "cancelled", "landed"))),
    "grades": ("Give a student's report card as JSON: the student's name, grades per subject (score out of 100) "
               "and whether they passed.",
               _obj(["student", "grades", "passed"], student=_str(30),
                    grades=_array(_obj(["subject", "score"],
                                       subject=_enum("math", "physics", "chemistry", "history", "english"),
                                       score=_int(0, 100)), 5),
                    passed=BOOL)),
    "http_log": ("Write one web server log entry as JSON: HTTP method, path, status code, duration in "
                 "milliseconds and optionally the content type and user agent headers.",
                 _obj(["method", "path", "status", "duration_ms"], method=_enum("GET", "POST", "PUT", "DELETE"),
                      path=_str(40), status=_int(100, 599), duration_ms=_num(0),
                      headers=_obj([], content_type=_str(30), user_agent=_str(40)))),
    "planet": ("Describe a planet of the solar system as JSON: name, number of moons, radius in km, whether it has "
               "rings and the main gases of its atmosphere.",
               _obj(["name", "moons", "radius_km", "has_rings", "atmosphere"], name=_str(20), moons=_int(0),
                    radius_km=_num(0), has_rings=BOOL,
                    atmosphere=_array(_enum("hydrogen", "helium", "nitrogen", "oxygen", "carbon dioxide",
                                            "methane", "argon"), 4))),
    "review": ("Write a restaurant review as JSON: restaurant, stars from 1 to 5, cuisine, a short comment and "
               "whether you would return.",
               _obj(["restaurant", "stars", "cuisine", "comment", "would_return"], restaurant=_str(40),
                    stars=_int(1, 5), cuisine=_enum("italian", "french", "japanese", "mexican", "indian", "other"),
                    comment=_str(80), would_return=BOOL)),
    "transaction": ("Record a bank transaction as JSON: id, amount, type, the account (IBAN and holder) and an "
                    "optional note.",
                    _obj(["id", "amount", "type", "account"], id=_str(12), amount=_num(),
                         type=_enum("deposit", "withdrawal", "transfer"),
                         account=_obj(["iban", "holder"], iban=_str(34), holder=_str(30)), note=_str(40))),
    "config": ("Write a service configuration as JSON: service name, port, debug flag, number of replicas, "
               "environment and up to three feature flags.",
               _obj(["service", "port", "debug", "replicas", "env"], service=_str(30), port=_int(1, 65535),
                    debug=BOOL, replicas=_int(1, 10), env=_enum("dev", "staging", "prod"),
                    features=_array(_str(20), 3))),
    "country": ("Describe a European country as JSON: name, capital, population, up to three languages, continent "
                "and whether it is an EU member (null if unsure).",
                _obj(["name", "capital", "population", "languages", "continent"], name=_str(30), capital=_str(30),
                     population=_int(0), languages=_array(_str(20), 3),
                     continent=_enum("Europe", "Asia", "Africa", "North America", "South America", "Oceania"),
                     eu_member={"type": ["boolean", "null"]})),
    "sensor": ("Give a temperature sensor's latest readings as JSON: sensor id, up to four readings, the unit, "
               "whether it is ok, and its location (latitude and longitude).",
               _obj(["sensor_id", "readings", "unit", "ok", "location"], sensor_id=_str(16),
                    readings=_array(_num(), 4), unit=_enum("C", "F", "K"), ok=BOOL,
                    location=_obj(["lat", "lon"], lat=_num(-90, 90), lon=_num(-180, 180)))),
    "character": ("Create a role-playing game character as JSON: name, class, level, stats (strength, dexterity, "
                  "intelligence) and an inventory of up to four items with counts.",
                  _obj(["name", "class", "level", "stats", "inventory"], name=_str(30),
                       **{"class": _enum("warrior", "mage", "rogue", "cleric")}, level=_int(1, 20),
                       stats=_obj(["strength", "dexterity", "intelligence"], strength=_int(1, 20),
                                  dexterity=_int(1, 20), intelligence=_int(1, 20)),
                       inventory=_array(_obj(["item", "count"], item=_str(20), count=_int(1, 99)), 4))),
}


def check(text: str, schema: dict) -> tuple[bool, bool, str | None]:
    """(parses, validates, the first error) of an answer against its schema."""
    import jsonschema
    try:
        doc = json.loads(text)
    except ValueError as e:
        return False, False, f"json: {e}"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as e:
        return True, False, f"schema: {e.message}"
    return True, True, None


def forced_positions(gen, grammar, token_ids: list[int]) -> int:
    """How many of the answer's tokens were the only one the grammar allowed where they were emitted (the final
    stop token included): the passes a forced-token shortcut could skip."""
    from specrt.decoding.grammar import Matcher
    matcher, forced = Matcher(grammar, gen.target.spec["vocab_size"]), 0
    for t in token_ids:
        forced += int(matcher.allowed().sum() == 1)
        if matcher.advance([t]) != 1:
            break
    return forced


def agreement(engine, prompt_ids: list[int], answer: list[int]) -> int:
    """At how many of the answer's positions `engine` (the target or the draft model, unconstrained) puts its argmax
    on the answer's token: one pass over the prompt and the answer."""
    import torch

    from specrt.engines.base import chain_mask
    ids = prompt_ids + answer[:-1]
    S = len(ids)
    cache = engine.new_cache(1, S + 1)
    out = engine.forward(torch.tensor([ids]), torch.arange(S)[None], cache.past_len, chain_mask(1, S), len(answer),
                         cache)   # logits (1, len(answer), V): those of the answer's positions
    return int((out.logits[0].argmax(-1) == torch.tensor(answer)).sum())


def _run(gen, name: str, prompt: str, schema: dict, method: str, arm: str, max_new_tokens: int,
         temperature: float = 0.0, seed: int | None = None) -> dict:
    grammar = gen.grammar("json_schema", schema) if arm == "grammar" else None
    out = gen.generate(prompt, max_new_tokens=max_new_tokens, method=method, temperature=temperature, seed=seed,
                       grammar=grammar)
    s, ids = out.stats, out.token_ids[0]
    wall = s["tokens"] / s["tokens_per_s"]
    rec = {"schema": name, "method": method, "arm": arm, "temperature": temperature, "seed": seed,
           "tokens": s["tokens"], "rounds": s["rounds"], "stop_reason": s["stop_reason"], "wall_s": wall,
           "prefill_s": s["prefill_time_s"], "tokens_per_s": s["tokens_per_s"],
           "mean_tokens_per_round": s["mean_tokens_per_round"], "acceptance_rate": s["acceptance_rate"],
           "text": out.text[0], "token_ids": ids}
    if grammar is not None:
        ok_json, valid, error = check(out.text[0], schema)
        rec.update(parses=ok_json, valid=valid, error=error, forced=forced_positions(gen, grammar, ids))
    return rec


def measure(gen, schemas: dict[str, tuple[str, dict]] = SCHEMAS, methods=METHODS, max_new_tokens: int = 160,
            speed_prompts: int | None = None, sampled_methods=SAMPLED_METHODS, temperature: float = 0.7,
            seed: int = 0, sampled_prompts: int | None = None, log=print) -> list[dict]:
    """Every run, in the order they ran: per schema, per method, the constrained greedy answer and (on the first
    `speed_prompts` schemas, all by default) the unconstrained one beside it; then the sampled constrained ones."""
    runs = []
    speed = len(schemas) if speed_prompts is None else speed_prompts
    for i, (name, (prompt, schema)) in enumerate(schemas.items()):
        gen.grammar("json_schema", schema)   # compile outside the timed runs (cached)
        arms = ("grammar", "none") if i % 2 == 0 else ("none", "grammar")
        for method in methods:
            for arm in arms if i < speed else ("grammar",):
                runs.append(_run(gen, name, prompt, schema, method, arm, max_new_tokens))
            g = next(r for r in runs[::-1] if r["arm"] == "grammar")
            log(f"{name:12s} {method:14s} {g['tokens']:4d} tokens {g['stop_reason']:15s} valid={g['valid']} "
                f"{g['tokens_per_s']:.1f} tok/s")
    for i, (name, (prompt, schema)) in enumerate(list(schemas.items())[:sampled_prompts]):
        for method in sampled_methods:
            r = _run(gen, name, prompt, schema, method, "grammar", max_new_tokens, temperature, seed + i)
            runs.append(r)
            log(f"{name:12s} {method:14s} T={temperature} {r['tokens']:4d} tokens valid={r['valid']}")
    for r in runs:   # after the timed runs: where the unconstrained target and draft model agree with the answers
        if r["method"] == "autoregressive" and r["temperature"] == 0:
            ids = gen.encode(schemas[r["schema"]][0])
            r["target_agrees"] = agreement(gen.target, ids, r["token_ids"])
            r["draft_agrees"] = agreement(gen.draft, ids, r["token_ids"]) if gen.has("draft") else None
    return runs


def _rate(runs: list[dict]) -> dict:
    """Decode tokens/s, end-to-end tokens/s and tokens per round over a set of runs (sums, not means of ratios)."""
    after_first = sum(r["tokens"] - 1 for r in runs)
    return {"runs": len(runs), "tokens": sum(r["tokens"] for r in runs),
            "decode_tokens_per_s": after_first / sum(r["wall_s"] - r["prefill_s"] for r in runs),
            "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
            "tokens_per_round": after_first / max(1, sum(r["rounds"] for r in runs))}


def _validity(runs: list[dict]) -> dict:
    return {"answers": len(runs), "finished": sum(r["stop_reason"] == "eos" for r in runs),
            "ran_long": sum(r["stop_reason"] == "max_new_tokens" for r in runs),
            "parse": sum(r["parses"] for r in runs), "valid": sum(r["valid"] for r in runs),
            "valid_of_finished": sum(r["valid"] for r in runs if r["stop_reason"] == "eos"),
            "unfinished": sorted(r["schema"] for r in runs if r["stop_reason"] != "eos"),
            "invalid_finished": sorted(r["schema"] for r in runs if r["stop_reason"] == "eos" and not r["valid"])}


def summarize(runs: list[dict]) -> dict:
    """The tables' figures, from the runs alone."""
    greedy = [r for r in runs if r["arm"] == "grammar" and r["temperature"] == 0]
    sampled = [r for r in runs if r["arm"] == "grammar" and r["temperature"] > 0]
    methods = list(dict.fromkeys(r["method"] for r in greedy))
    ar = {r["schema"]: r["token_ids"] for r in greedy if r["method"] == "autoregressive"}
    paired = {r["schema"] for r in runs if r["arm"] == "none"}
    out = {"greedy": {}, "identical": {}, "speed": {}, "sampled": {}, "agreement": {}}
    for m in methods:
        mine = [r for r in greedy if r["method"] == m]
        out["greedy"][m] = {**_validity(mine), "rate": _rate(mine), "forced": sum(r["forced"] for r in mine)}
        same = [r["schema"] for r in mine if r["schema"] in ar and r["token_ids"] == ar[r["schema"]]]
        out["identical"][m] = {"compared": sum(r["schema"] in ar for r in mine), "identical": len(same),
                               "differ": sorted(r["schema"] for r in mine if r["schema"] in ar
                                                and r["token_ids"] != ar[r["schema"]])}
        with_g = [r for r in mine if r["schema"] in paired]
        without = [r for r in runs if r["arm"] == "none" and r["method"] == m]
        if with_g and without:
            a, b = _rate(with_g), _rate(without)
            out["speed"][m] = {"grammar": a, "none": b,
                               "forced": sum(r["forced"] for r in with_g),
                               **{f"ratio_{k}": a[k] / b[k] for k in ("decode_tokens_per_s", "tokens_per_s",
                                                                      "tokens_per_round")}}
    for arm in ("grammar", "none"):
        scored = [r for r in runs if r["arm"] == arm and r.get("target_agrees") is not None]
        if scored:
            out["agreement"][arm] = {"answers": len(scored), "positions": sum(r["tokens"] for r in scored),
                                     **{k: (sum(r[f"{k}_agrees"] for r in scored)
                                            if all(r[f"{k}_agrees"] is not None for r in scored) else None)
                                        for k in ("target", "draft")}}
    for m in dict.fromkeys(r["method"] for r in sampled):
        mine = [r for r in sampled if r["method"] == m]
        out["sampled"][m] = {"temperature": mine[0]["temperature"], **_validity(mine)}
    return out


def tables(summary: dict) -> str:
    """The summary as Markdown tables."""
    lines = ["Greedy, with the grammar: answers that parse and validate; identical to constrained autoregressive", "",
             "| method | answers | finished (eos) | ran to max_new_tokens | parse | validate | identical to AR | "
             "tokens/round | decode tok/s | forced tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, v in summary["greedy"].items():
        same, rate = summary["identical"][m], v["rate"]
        lines.append(f"| {m} | {v['answers']} | {v['finished']} | {v['ran_long']} | {v['parse']} | {v['valid']} | "
                     f"{same['identical']}/{same['compared']} | {rate['tokens_per_round']:.2f} | "
                     f"{rate['decode_tokens_per_s']:.1f} | {v['forced']} "
                     f"({v['forced'] / max(1, rate['tokens']):.0%}) |")
    if summary["sampled"]:
        lines += ["", "Sampled, with the grammar", "",
                  "| method | T | answers | finished | ran long | parse | validate |", "|---|---|---|---|---|---|---|"]
        for m, v in summary["sampled"].items():
            lines.append(f"| {m} | {v['temperature']} | {v['answers']} | {v['finished']} | {v['ran_long']} | "
                         f"{v['parse']} | {v['valid']} |")
    if summary["speed"]:
        lines += ["", "Speed, greedy, with the grammar against without (same prompts, interleaved)", "",
                  "| method | prompts | tokens with / without | decode tok/s with / without (ratio) | "
                  "end-to-end tok/s with / without (ratio) | tokens/round with / without (ratio) | forced tokens |",
                  "|---|---|---|---|---|---|---|"]
        for m, v in summary["speed"].items():
            a, b = v["grammar"], v["none"]
            lines.append(
                f"| {m} | {a['runs']} | {a['tokens']} / {b['tokens']} | {a['decode_tokens_per_s']:.1f} / "
                f"{b['decode_tokens_per_s']:.1f} ({v['ratio_decode_tokens_per_s']:.2f}) | {a['tokens_per_s']:.1f} / "
                f"{b['tokens_per_s']:.1f} ({v['ratio_tokens_per_s']:.2f}) | {a['tokens_per_round']:.2f} / "
                f"{b['tokens_per_round']:.2f} ({v['ratio_tokens_per_round']:.2f}) | {v['forced']} "
                f"({v['forced'] / max(1, a['tokens']):.0%}) |")
    if summary["agreement"]:
        lines += ["", "Constrained autoregressive answers (grammar) and unconstrained ones (none): positions where the "
                  "unconstrained target's and draft model's argmax is the answer's token", "",
                  "| answers | positions | target agrees | draft model agrees |", "|---|---|---|---|"]
        for arm, v in summary["agreement"].items():
            share = (lambda k: "n/a" if v[k] is None else f"{v[k]} ({v[k] / max(1, v['positions']):.0%})")
            lines.append(f"| {arm} ({v['answers']}) | {v['positions']} | {share('target')} | {share('draft')} |")
    return "\n".join(lines)


@click.command()
@click.option("--engines", default="engines/default", show_default=True, help="the engine set")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="folder for structured.json")
@click.option("--methods", default=",".join(METHODS), show_default=True)
@click.option("--schemas", "num_schemas", type=int, default=len(SCHEMAS), show_default=True,
              help="the first N schemas")
@click.option("--max-new-tokens", type=int, default=160, show_default=True)
@click.option("--speed-prompts", type=int, default=4, show_default=True,
              help="the unconstrained arm on the first N schemas")
@click.option("--sampled-methods", default=",".join(SAMPLED_METHODS), show_default=True,
              help="methods run at --temperature with the grammar ('' for none)")
@click.option("--sampled-prompts", type=int, default=6, show_default=True, help="sampled on the first N schemas")
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="schema i samples with seed + i")
def main(engines, out, methods, num_schemas, max_new_tokens, speed_prompts, sampled_methods, sampled_prompts,
         temperature, seed):
    from specrt import Generator
    gen = Generator.from_engines(engines)
    schemas = dict(list(SCHEMAS.items())[:num_schemas])
    began = time.perf_counter()
    runs = measure(gen, schemas, [m for m in methods.split(",") if m], max_new_tokens, speed_prompts,
                   [m for m in sampled_methods.split(",") if m], temperature, seed, sampled_prompts,
                   log=lambda s: click.echo(s, err=True))
    summary = summarize(runs)
    info = {"engines": str(engines), "max_new_tokens": max_new_tokens, "schemas": list(schemas),
            "llguidance": version("llguidance"), "machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "wall_s": time.perf_counter() - began}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "structured.json").write_text(json.dumps({"info": info, "runs": runs, "summary": summary},
                                                          indent=1, default=_plain))
    click.echo(tables(summary))


def _plain(x):
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    main()
