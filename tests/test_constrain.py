"""Structured output (hylo.constrain): constraints checked and compiled, the device tables' masks against the
grammar engine's own matcher step by step, and constrained generation on the embedded default model (its own
byte-level BPE tokenizer and MTP head): every output matches its constraint, greedy and sampled, plain and
speculative, beside unconstrained requests that it leaves as they were."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.constrain.automaton import AutomatonCache
from hylo.constrain.spec import Constraint
from hylo.constrain.tables import ConstraintTables
from hylo.tokenizer import HFTokenizer

from hylo.models.default import trained_default_path

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "count": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c d"]}, "maxItems": 3},
                         "ok": {"type": ["boolean", "null"]}},
          "required": ["name", "count"]}
REGEX = r"[0-9]{3}-[a-z]{2,5}( [A-Z]{1,6})?"
CHOICES = ["import os", "def main():", "return None"]


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(trained_default_path())


@pytest.fixture(scope="module")
def cache(tok):
    return AutomatonCache(tok, tok.vocab_size)


def _allowed_by_tables(tables, slot, vocab):
    logits = torch.zeros(1, vocab)
    slots = torch.tensor([slot])
    masked = tables.mask_logits(logits, tables.state[slots], slots)
    return set(torch.isfinite(masked[0]).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("constraint", [Constraint.regex(REGEX), Constraint.choice(CHOICES),
                                        Constraint.json_schema(SCHEMA), Constraint.json_object()],
                         ids=["regex", "choice", "json_schema", "json_object"])
def test_device_masks_follow_the_grammar_engines_matcher(tok, cache, constraint):
    """Along random walks through the constraint, the device tables' mask at every step is exactly the token set
    outlines-core's own Guide allows there (its end-of-sequence standing for the model's), and the device state
    moves on with the token as the Guide does."""
    from outlines_core import Guide, Index, Vocabulary

    from hylo.constrain.automaton import vocabulary_bytes

    vocab, eos = tok.vocab_size, 0
    auto = cache.get(constraint)
    guide_index = Index(constraint.to_regex(), Vocabulary(vocab, vocabulary_bytes(tok, vocab)))
    tables = ConstraintTables(4, vocab, torch.device("cpu"), {eos})
    rng = random.Random(7)
    steps = 0
    for walk in range(6):
        guide = Guide(guide_index)
        tables.register(2, auto)
        while True:
            want = {eos if t == vocab else t for t in guide.get_tokens()}
            assert _allowed_by_tables(tables, 2, vocab) == want
            steps += 1
            choices = sorted(want - {eos})
            if not choices or (eos in want and rng.random() < 0.3):
                break
            # bias towards short tokens that close structures, so that walks end
            t = rng.choice(choices)
            guide.advance(t, return_tokens=False)
            slot = torch.tensor([2])
            tables.advance(slot, tables.state[slot], torch.tensor([t]))
            if steps > 400:
                break
    assert steps > 20


def test_constraints_are_checked_and_refused_by_name(tok, cache):
    with pytest.raises(ValueError, match="'minimum'.*properties/n"):
        Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}})
    for bad, match in [({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "'not'"),
                       ({"type": "string", "format": "ipv4"}, "format 'ipv4'"),
                       ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
                       ({"type": "object", "minProperties": 2}, "minProperties")]:
        with pytest.raises(ValueError, match=match):
            Constraint.json_schema(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ValueError, match="non-empty list"):
        Constraint.choice([])
    with pytest.raises(ValueError, match="regex constraint: cannot be compiled"):
        cache.get(Constraint.regex("(unclosed"))
    with pytest.raises(ValueError, match="Unsupported type"):
        cache.get(Constraint.json_schema({"type": "strin"}))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(constraint=Constraint.regex("a+"), ignore_eos=True)
    with pytest.raises(ValueError, match="Constraint"):
        SamplingParams(constraint="a+")
    # annotations and neutral values pass; a pattern with a top-level alternation stays inside the quotes
    c = Constraint.json_schema({"title": "t", "type": "string", "pattern": "^a|b$", "uniqueItems": False})
    auto = cache.get(c)
    assert auto.walk(tok.encode('"a"')) is not None and auto.walk(tok.encode('"a')) is not None
    assert not auto.final[auto.walk(tok.encode('"a'))] and auto.final[auto.walk(tok.encode('"b"'))]


@pytest.mark.parametrize("fmt,good,bad", [
    ("time", "21:34:39.25Z", ["21:34:39\\q5", "21:34:39\\\"5"]),
    ("email", "a.b+c@ex-ample.org", ['\\"x\\"@a.bc', '\\u0001@a.bc']),
    ("uri", "https://ex.org/a?b=1#c", ["https://ex.org/a\\\"b", "https://ex.org/\\\\"]),
    ("date-time", "2026-12-08T02:30:00Z", []), ("date", "2026-12-08", ["\u0664026-12-08"]),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", [])])
def test_string_formats_stay_valid_json(tok, cache, fmt, good, bad):
    """A string ``format`` is enforced with nothing a JSON string must escape inside it (outlines-core's own
    "time" allowed a backslash before any character, its "email" a quoted local part, its "uri" quotes and
    backslashes: outputs that were not JSON; its "date" any Unicode digit), and every output a walk through the
    automaton can end is JSON holding a value of the format."""
    schema = {"type": "string", "format": fmt}
    regex = Constraint.json_schema(schema).to_regex()
    assert re.fullmatch(regex, json.dumps(good))
    for text in bad:  # JSON string bodies whose escapes are not the format's value
        assert not re.fullmatch(regex, f'"{text}"'), text
    auto, rng, ended = cache.get(Constraint.json_schema(schema)), random.Random(3), 0
    singles = {t for t in range(tok.vocab_size) if len(tok.decode([t])) == 1}  # mostly these: walks that end
    for _ in range(40):
        state, out = auto.initial, []
        while len(out) < 300:
            allowed = auto.allowed(state)
            if auto.final[state] and (rng.random() < 0.2 or not len(allowed)):
                value = json.loads(tok.decode(out))
                assert isinstance(value, str) and re.fullmatch(regex, json.dumps(value, ensure_ascii=False)), value
                ended += 1
                break
            short = [t for t in allowed.tolist() if t in singles]
            t = rng.choice(short if short and rng.random() < 0.8 else allowed.tolist())
            out.append(t)
            state = auto.step(state, t)
    assert ended >= 10


def test_a_property_named_like_a_keyword_is_still_a_schema():
    """A property called "enum" (or const, default, examples) holds a schema whose pattern is grouped like any
    other: ungrouped, its top-level alternation split the object's expression (``{"enum":"a`` matched)."""
    for name in ("enum", "const", "default", "examples"):
        regex = Constraint.json_schema({"type": "object", "properties": {name: {"type": "string", "pattern": "a|b"}},
                                        "required": [name]}).to_regex()
        assert re.fullmatch(regex, json.dumps({name: "a"}, separators=(",", ":")))
        assert not re.fullmatch(regex, f'{{"{name}":"a') and not re.fullmatch(regex, 'b"}')


def test_a_long_list_of_choices_compiles_under_the_child_processs_limits(tok, monkeypatch):
    """Choices up to a few thousand characters compile in-process; a longer list (its size is the client's to
    choose) compiles in the child process, under its time and memory limits, as a regex does."""
    from hylo.constrain import automaton

    seen = []
    child = automaton._compile_in_child
    monkeypatch.setattr(automaton, "_compile_in_child", lambda c, *a: seen.append(c.kind) or child(c, *a))
    cache = AutomatonCache(tok, tok.vocab_size, eos_ids={0})
    short = cache.get(Constraint.choice(["yes", "no"]))
    words = [f"word{i:05d}" for i in range(600)]  # 6000 characters
    long = cache.get(Constraint.choice(words))
    assert seen == ["choice"]
    assert long.final[long.walk(tok.encode(words[123]))] and short.walk(tok.encode("maybe")) is None


def test_a_constraint_that_fails_to_compile_is_not_compiled_again_by_each_caller(tok, monkeypatch):
    """Callers waiting on a compile that fails (a time limit passed, say: a minute each) get its error at once, and
    so does the next request with the same constraint for a while: the compile ran once, not once per caller."""
    import threading
    import time

    from hylo.constrain import automaton

    calls = []

    def failing(constraint, *args):
        calls.append(constraint)
        time.sleep(0.3)  # the waiters arrive meanwhile
        raise ValueError("regex constraint: its automaton did not compile within 60 s")
    monkeypatch.setattr(automaton, "compile_automaton", failing)
    cache = AutomatonCache(tok, tok.vocab_size, eos_ids={0})
    bad, errors = Constraint.regex("(a|b)*a(a|b){25}"), []

    def ask():
        try:
            cache.get(bad)
        except ValueError as e:
            errors.append(str(e))
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ask()
    assert len(calls) == 1 and len(errors) == 5 and all("within 60 s" in e for e in errors)
    monkeypatch.setattr(automaton, "FAILED_TTL_S", 0.0)  # once it has expired, a compile is tried again
    ask()
    assert len(calls) == 2


def test_at_most_two_child_compiles_run_at_once(monkeypatch):
    """A burst of constraints whose automata explode (each child may take its whole memory cap) runs two children
    at a time; the others wait their turn."""
    import threading
    import time

    from hylo.constrain import automaton

    running, peak, lock = [0], [0], threading.Lock()

    def child(*args):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return {}
    monkeypatch.setattr(automaton, "_run_child", child)
    threads = [threading.Thread(target=automaton._compile_in_child, args=(None, "a", 4, {})) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2


def test_string_keywords_the_translation_would_drop_are_refused():
    """The translation reads one of a string's length bounds, pattern or format and drops the others: a schema
    with two of them is refused by name (a length alone, or both bounds, is fine)."""
    for schema, words in [({"type": "string", "pattern": "a+", "maxLength": 3}, "maxLength beside pattern"),
                          ({"type": "string", "format": "uuid", "minLength": 5}, "minLength beside format"),
                          ({"type": "string", "format": "date", "pattern": "2.*"}, "pattern beside format")]:
        with pytest.raises(ValueError, match=words):
            Constraint.json_schema(schema)
    Constraint.json_schema({"type": "string", "minLength": 1, "maxLength": 3})


def _accepts(auto, tok, text: str) -> bool:
    state = auto.walk(tok.encode(text))
    return state is not None and bool(auto.final[state])


def test_schemas_the_translation_would_loosen_are_merged_or_refused(tok, cache):
    """outlines-core's translation concatenates allOf's branches, reads one keyword family per schema, cuts
    recursion leaving invalid JSON and writes property names unescaped: allOf is merged into one schema, the rest
    refused by name, so that what is accepted always validates."""
    two = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                     {"type": "object", "properties": {"b": {"type": "string", "maxLength": 3}}, "required": ["b"]}]}
    auto = cache.get(Constraint.json_schema(two))
    assert _accepts(auto, tok, '{"a": 1, "b": "xy"}')
    assert not _accepts(auto, tok, '{"a": 1}{"b": "xy"}') and not _accepts(auto, tok, '{"a": 1}')
    for text in ('{"a": 1, "b": "xy"}', '{"a":-7,"b":""}'):
        jsonschema.validate(json.loads(text), two)
    # a property given as allOf of one reference (pydantic's shape for a described field) keeps the reference
    ref = {"type": "object", "properties": {"m": {"allOf": [{"$ref": "#/$defs/M"}], "description": "d"}},
           "required": ["m"], "$defs": {"M": {"enum": ["x", "y"]}}}
    auto = cache.get(Constraint.json_schema(ref))
    assert _accepts(auto, tok, '{"m": "y"}') and not _accepts(auto, tok, '{"m": "z"}')
    assert _accepts(cache.get(Constraint.json_schema({"allOf": [{"type": "number"}, {"type": "integer"}]})),
                    tok, "12") and not _accepts(cache.get(Constraint.json_schema(
                        {"allOf": [{"type": "number"}, {"type": "integer"}]})), tok, "1.5")
    node = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
            "required": ["v", "next"]}
    for bad, match in [
            ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "nothing matches both"),
            ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"type": "string"}}}]},
             "property 'a' two different schemas"),
            ({"allOf": [{"type": "string", "maxLength": 3}, {"maxLength": 4}]}, "sets 'maxLength'"),
            ({"$defs": {"n": node}, "$ref": "#/$defs/n"}, r"'#/\$defs/n' is recursive"),
            ({"type": "object", "properties": {"child": {"$ref": "#"}}}, "'#' is recursive"),
            ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
            ({"$ref": "#/$defs/missing"}, "does not resolve"),
            ({"$ref": "#/$defs/N", "properties": {"x": {"type": "string"}}, "$defs": {"N": {"type": "integer"}}},
             r"\$ref \(at /\) beside properties"),
            ({"type": "object", "properties": {"a": {"type": "integer"}},
              "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
             "anyOf .at /. beside type, properties"),
            ({"type": "string", "minLength": 2, "enum": ["a", "bb"]}, "enum .at /. beside minLength"),
            ({"type": "string", "enum": ["a", 1]}, "enum value 1 .at /. is not of type"),
            ({"type": "array", "items": {"type": "integer"}, "prefixItems": [{"type": "string"}]}, "prefixItems"),
            ({"type": "object", "properties": {'a"b': {"type": "integer"}}}, "property name 'a\"b'"),
            ({"type": "object", "properties": {"x": {"type": "object", "properties": {"a\nb": {}}}}},
             "/properties/x/properties")]:
        with pytest.raises(ValueError, match=match):
            Constraint.json_schema(bad)
    # what stays allowed: references reached twice without a cycle, names with regex metacharacters, a property
    # named like a keyword, null beside a type list's enum
    dag = {"$defs": {"a": {"type": "integer"}}, "type": "object", "required": ["p", "q"],
           "properties": {"p": {"$ref": "#/$defs/a"}, "q": {"$ref": "#/$defs/a"}, "$ref": {"type": "string"},
                          "a.b*(c)": {"type": ["string", "null"], "enum": ["u", None]}}}
    auto = cache.get(Constraint.json_schema(dag))
    assert _accepts(auto, tok, '{"p": 1, "q": 2, "$ref": "s", "a.b*(c)": null}')
    assert not _accepts(auto, tok, '{"p": 1, "q": 2, "$ref": "s", "aXb*(c)": null}')


def test_tables_keep_live_automata_and_renumber_states(tok, cache):
    """Three automata through two slots: the one no slot uses any more leaves the table, the other slot's state
    is renumbered to the same place of its automaton; a preempted request's state is its automaton walked over
    the tokens it emitted; an unconstrained request in a reused slot is unconstrained."""
    vocab = tok.vocab_size
    tables = ConstraintTables(4, vocab, torch.device("cpu"), {0})
    a, b, c = (cache.get(x) for x in (Constraint.regex(REGEX), Constraint.choice(CHOICES), Constraint.json_object()))
    out = tok.encode("def")
    tables.register(1, a)
    tables.register(2, b, out)
    before = _allowed_by_tables(tables, 2, vocab)
    assert before == set(b.allowed(b.walk(out)).tolist())
    tables.register(1, c)
    assert tables.num_states == 1 + b.num_states + c.num_states  # a left the table
    assert _allowed_by_tables(tables, 2, vocab) == before
    tables.register(1, None)
    assert tables.state[1].item() == -1 and len(_allowed_by_tables(tables, 1, vocab)) == vocab
    # a finished request's automaton leaves at the next rebuild, not when its slot is next used
    tables.release(2)
    tables.register(3, a)
    assert tables.num_states == 1 + a.num_states


def test_an_ended_requests_automaton_leaves_the_device_table(llms):
    """Through the engine: after a constrained request ends, the next constraint's rebuild drops its automaton
    (the table held every finished slot's automaton until that slot was used again)."""
    llm = llms(None)
    tables_of = lambda: llm.engine.caches.req_slots.constraints  # noqa: E731
    # the choice's request ends first, so its slot is not the one the next request takes
    llm.generate(["\n", "x"], [SamplingParams(max_tokens=8, constraint=Constraint.choice(CHOICES)),
                               SamplingParams(max_tokens=30, ignore_eos=True)], use_tqdm=False)
    llm.generate(["\n"], SamplingParams(max_tokens=30, constraint=Constraint.regex(REGEX)), use_tqdm=False)
    regex = llm.engine.compile_constraint(Constraint.regex(REGEX))
    assert tables_of().num_states == 1 + regex.num_states


def _check(constraint: Constraint, text: str) -> None:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.value))
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.value, text), text
    elif constraint.kind == "grammar":
        assert re.fullmatch(GRAMMAR_RE, text), text
    else:
        assert text in constraint.value


@pytest.fixture(scope="module")
def llms():
    made = {}

    def get(spec):
        if spec not in made:
            kw = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
            made[spec] = LLM(None, device="cpu", verbose=False, max_num_seqs=8, chunk_size=24, **kw)
        return made[spec]
    return get


# a context-free grammar (Lark; matched on the host by llguidance) and a regular expression of the same language
GRAMMAR = 'start: "def " NAME "(" NAME? ")" ":"\nNAME: /[a-z_]{1,10}/\n'
GRAMMAR_RE = r"def [a-z_]{1,10}\(([a-z_]{1,10})?\):"
PROMPTS = ["def f(x):\n    return", "import sys\n", "class A:\n    def __init__(self):", "# a comment\n", "\n\n"]
CONSTRAINTS = [Constraint.json_schema(SCHEMA), Constraint.regex(REGEX), Constraint.choice(CHOICES),
               Constraint.json_object(), Constraint.grammar(GRAMMAR)]


@pytest.mark.parametrize("spec", [None, "ngram", "mtp"])
def test_constrained_outputs_match_their_constraints(llms, spec):
    """A batch of constrained requests (each kind, greedy and sampled) beside free ones: every constrained output
    ends where its constraint may (finish reason stop) and matches it; the free requests' outputs are those they
    get alone; greedy constrained outputs are the same with and without speculation (lossless)."""
    llm = llms(spec)
    params, prompts = [], []
    for i, c in enumerate(CONSTRAINTS):
        for temp in (0.0, 0.9):
            params.append(SamplingParams(max_tokens=120, temperature=temp, seed=11 + i, constraint=c))
            prompts.append(PROMPTS[i])
    free = SamplingParams(max_tokens=24, temperature=0)
    params += [free, free]
    prompts += PROMPTS[:2]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(params, outs):
        if p.constraint is None:
            continue
        if o.finish_reason == "stop":
            _check(p.constraint, o.text)
        else:  # only an unbounded constraint may run out of tokens (this small model repeats keys), on its way
            assert p.constraint.kind == "json_object" and o.finish_reason == "length", (p.constraint, o.text)
            assert llm.engine.compile_constraint(p.constraint).walk(o.token_ids) is not None
    assert sum(o.finish_reason == "stop" for o in outs[:-2]) >= 8
    assert llm.engine.host_syncs > 0  # the grammar rows' steps read the step before them first
    alone = llm.generate(PROMPTS[:2], [free, free], use_tqdm=False)
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in alone]
    if spec is not None:
        plain = llms(None).generate(prompts, params, use_tqdm=False)
        for p, a, b in zip(params, outs, plain):
            if p.temperature == 0:
                assert a.token_ids == b.token_ids, (p.constraint, a.text, b.text)


def test_speculative_sampling_keeps_the_constrained_distribution(llms):
    """Sampled choice among three answers: the n-gram verify (drafts checked against the masked target, rejected
    where the constraint forbids them) gives the plain decoder's distribution (chi-square, 300 samples each)."""
    c = Constraint.choice(["yes", "no", "maybe"])
    counts = []
    for spec in (None, "ngram"):
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=1000 + i, constraint=c) for i in range(300)]
        outs = llms(spec).generate(["answer: "] * 300, params, use_tqdm=False)
        counts.append([sum(o.text == w for o in outs) for w in c.value])
        assert sum(counts[-1]) == 300
    a, b = np.array(counts[0], float), np.array(counts[1], float)
    keep = (a + b) > 0
    chi2 = (((a - b) ** 2) / (a + b))[keep].sum()
    assert chi2 < 13.8, counts  # 2 degrees of freedom, p = 0.001


def test_grammars_are_matched_on_the_host(llms):
    """GBNF and Lark grammars (llguidance on the host): outputs in their language; the host mask reaches the device
    table (a grammar row's allowed set is the matcher's); a broken grammar is refused naming the problem; while a
    grammar row runs the steps read the step before them (counted), and without one they overlap again."""
    llm = llms(None)
    eng = llm.engine
    gbnf = 'root ::= "x = " [0-9] [0-9]? " # " ("yes" | "no")'
    outs = llm.generate(["\n"] * 3, [SamplingParams(max_tokens=30, temperature=t, seed=5, constraint=Constraint.grammar(gbnf))
                                     for t in (0.0, 0.7, 1.0)], use_tqdm=False)
    for o in outs:
        assert re.fullmatch(r"x = [0-9][0-9]? # (yes|no)", o.text), o.text
    with pytest.raises(ValueError, match="grammar constraint"):
        eng.compile_constraint(Constraint.grammar('start: "a" undefined_rule'))
    with pytest.raises(ValueError, match="grammar constraint"):
        Constraint.grammar("   ")
    # the device table takes a host row's mask from host_masks
    tok = eng.tokenizer
    matcher = eng.compile_constraint(Constraint.grammar(gbnf)).matcher()
    matcher.feed(tok.encode("x = 4", add_special_tokens=False))
    tables = ConstraintTables(4, eng.model_config.vocab_size, torch.device("cpu"), {0})
    tables.register(3, matcher)
    tables.set_host_masks([3], [matcher.mask()])
    allowed = _allowed_by_tables(tables, 3, eng.model_config.vocab_size)
    assert allowed and all(re.fullmatch(r"[0-9]?( (# ?)?)?", tok.decode([t])) or tok.decode([t]) in (" #", " # ")
                           or tok.decode([t]).startswith(" # ") for t in allowed), [tok.decode([t]) for t in allowed]
    before = eng.host_syncs
    llm.generate(["\n"], [SamplingParams(max_tokens=8, temperature=0)], use_tqdm=False)
    assert eng.host_syncs == before


def test_a_grammar_the_matcher_gives_up_on_ends_only_its_own_request(llms, capfd):
    """A grammar that passes validation but that llguidance gives up on while decoding (no finite match, or a
    count past its item limits) ends its own request with a 400 naming the grammar, at the step before the one it
    would have shared: the plain and the good grammar requests beside it finish as they do alone, and nothing is
    logged (a client's grammar is not the engine's error). A grammar no text matches is refused when compiled."""
    eng = llms(None).engine
    good = 'root ::= "x = " [0-9] [0-9]? " # " ("yes" | "no")'
    params = {"plain": SamplingParams(max_tokens=24, temperature=0),
              "good": SamplingParams(max_tokens=30, temperature=0, constraint=Constraint.grammar(good))}
    alone = {}
    for rid, p in params.items():
        eng.add_request("def f(x):", p, request_id=f"alone-{rid}")
        while eng.has_unfinished():
            for r in eng.step():
                if r.finished:
                    alone[rid] = list(r.output_ids)
                    eng.pop_finished(r.rid)
    capfd.readouterr()
    for rid, p in params.items():
        eng.add_request("def f(x):", p, request_id=rid)
    for rid, g in (("endless", 'root ::= "a" root'), ("huge", 'root ::= "a"{1000000}')):
        eng.add_request("x", SamplingParams(max_tokens=40, constraint=Constraint.grammar(g)), request_id=rid)
    done = {}
    while eng.has_unfinished():
        for r in eng.step():
            if r.finished:
                done[r.rid] = eng.pop_finished(r.rid)
    for rid in params:
        assert done[rid].error is None and done[rid].token_ids == alone[rid], rid
    for rid in ("endless", "huge"):
        out = done[rid]
        assert out.finish_reason == "abort" and out.error_status == 400, (rid, out)
        assert out.error.startswith("grammar constraint: the grammar engine stopped after"), out.error
    logged = capfd.readouterr()
    assert "Traceback" not in logged.err and "error" not in logged.err.lower(), logged.err
    with pytest.raises(ValueError, match="grammar constraint: the grammar engine stopped before the first"):
        eng.compile_constraint(Constraint.grammar("root ::= root"))
    with pytest.raises(ValueError, match="prompt 0: grammar constraint"):
        llms(None).generate(["x"], [SamplingParams(max_tokens=8, constraint=Constraint.grammar('root ::= "b" root'))],
                            use_tqdm=False)


def test_mtp_drafts_follow_the_constraint(monkeypatch):
    """The MTP head drafts constrained rows under their constraint (each draft masked by the state after the ones
    before it): the verify accepts more of them than of unmasked drafts, on the same requests; the outputs stay
    the constrained greedy ones."""
    import dataclasses

    import hylo.speculative.mtp as mtp

    params = [SamplingParams(max_tokens=100, temperature=0, constraint=c) for c in CONSTRAINTS[:4]]

    def run():
        llm = LLM(None, device="cpu", verbose=False, speculative="mtp", num_speculative_tokens=3,
                  spec_policy="fixed", max_num_seqs=4)
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        return [o.token_ids for o in outs], sum(o.spec.emitted_tokens for o in outs) / sum(
            o.spec.verify_steps for o in outs)

    masked_ids, masked = run()
    pick = mtp.MTPDrafter._pick

    def unmasked_pick(self, logits, req_slots, sb, base, i, worker=None):
        if sb is not None and sb.constrained:
            sb = dataclasses.replace(sb, constrained=False)
        return pick(self, logits, req_slots, sb, base, i, worker)

    monkeypatch.setattr(mtp.MTPDrafter, "_pick", unmasked_pick)
    plain_ids, plain = run()
    assert masked_ids == plain_ids
    assert masked > plain + 0.3, (masked, plain)
