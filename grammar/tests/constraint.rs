//! The constraint over the default model's real vocabulary: every path through the mask writes
//! text of the grammar's language, whatever the scores say.

use rand::{Rng, SeedableRng};
use serde_json::Value;
use tandem_grammar::{Grammar, GrammarError, Grammars, MAX_GRAMMAR_BYTES, MAX_GRAMMAR_DEPTH};
use tandem_model::Tokenizer;

fn tokenizer() -> (Tokenizer, usize) {
    let p = tandem_model::default_model_path();
    assert!(
        p.exists(),
        "{} missing: run scripts/test (it fetches the model)",
        p.display()
    );
    let m = tandem_model::load_text(&p).expect("model text");
    let vocab = m.config.vocab_size;
    (m.tokenizer, vocab)
}

/// Samples `max` tokens from random scores under the constraint (the scores stand in for a
/// model's: the mask alone must keep the text in the language); returns the text and whether
/// it ended at EOS.
fn walk(
    g: &Grammars,
    tok: &Tokenizer,
    vocab: usize,
    grammar: &Grammar,
    seed: u64,
    max: usize,
) -> (String, bool) {
    let mut c = g.compile(grammar).expect("compiles");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..max {
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-4.0..4.0)).collect();
        let mask = c.allowed().unwrap();
        assert!(mask.count() > 0, "the mask allows something");
        mask.apply(&mut logits);
        let t = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        assert!(mask.allows(t));
        if tok.is_eos(t) {
            c.consume(t).expect("EOS is allowed where the grammar ends");
            return (tok.decode(&out, false).unwrap(), true);
        }
        c.consume(t).expect("an allowed token is accepted");
        out.push(t);
        if c.is_finished() {
            return (tok.decode(&out, false).unwrap(), true);
        }
    }
    (tok.decode(&out, false).unwrap(), false)
}

#[test]
fn random_scores_under_a_schema_write_valid_json() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false,
    });
    let grammar = Grammar::JsonSchema(schema.to_string());
    let mut ended = 0;
    for seed in 0..8 {
        let (text, done) = walk(&g, &tok, vocab, &grammar, seed, 200);
        if !done {
            continue;
        }
        ended += 1;
        let v: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        let age = o["age"].as_i64().unwrap();
        assert!((0..=150).contains(&age), "{text}");
        for t in o["tags"].as_array().unwrap() {
            assert!(["a", "b", "c"].contains(&t.as_str().unwrap()), "{text}");
        }
    }
    assert!(
        ended >= 4,
        "most random walks finish the object ({ended} of 8)"
    );
}

#[test]
fn choice_regex_and_lark_hold() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let choice = Grammar::Choice(vec!["yes".into(), "no".into(), "maybe \"so\"".into()]);
    for seed in 0..6 {
        let (text, done) = walk(&g, &tok, vocab, &choice, seed, 20);
        assert!(done);
        assert!(
            ["yes", "no", "maybe \"so\""].contains(&text.as_str()),
            "{text:?}"
        );
    }
    let rx = Grammar::Regex(r"[0-9]{3}-[a-z]{2}".into());
    for seed in 0..6 {
        let (text, done) = walk(&g, &tok, vocab, &rx, seed, 20);
        assert!(done);
        let b = text.as_bytes();
        assert_eq!(b.len(), 6, "{text:?}");
        assert!(
            b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
            "{text:?}"
        );
        assert!(b[4..].iter().all(u8::is_ascii_lowercase), "{text:?}");
    }
    let lark = Grammar::Lark("start: \"(\" num (\"+\" num)* \")\"\nnum: /[1-9][0-9]?/".into());
    for seed in 0..6 {
        let (text, done) = walk(&g, &tok, vocab, &lark, seed, 40);
        if done {
            assert!(text.starts_with('(') && text.ends_with(')'), "{text:?}");
            for n in text[1..text.len() - 1].split('+') {
                let n: u32 = n.parse().unwrap_or_else(|_| panic!("{text:?}"));
                assert!((1..100).contains(&n), "{text:?}");
            }
        }
    }
}

#[test]
fn json_object_allows_any_object_and_only_objects() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let mut c = g.compile(&Grammar::JsonObject).unwrap();
    let mask = c.allowed().unwrap();
    let open = tok.encode("{", false).unwrap();
    let bracket = tok.encode("[", false).unwrap();
    assert!(mask.allows(open[0]));
    assert!(
        !mask.allows(bracket[0]),
        "a top-level array is not an object"
    );
    assert!(
        !tok.eos_token_ids.iter().any(|&e| mask.allows(e)),
        "nothing written is not JSON"
    );
    for t in tok.encode("{\"a\": [1, 2]}", false).unwrap() {
        assert!(c.allowed().unwrap().allows(t));
        c.consume(t).unwrap();
    }
    let end = c.allowed().unwrap();
    assert!(
        tok.eos_token_ids.iter().all(|&e| end.allows(e)),
        "a complete object may end"
    );
}

#[test]
fn bad_grammars_are_refused_with_the_reason() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let refused = |gr: Grammar| match g.compile(&gr) {
        Err(GrammarError::Invalid(m)) => m,
        Ok(_) => panic!("{gr:?} compiled"),
        Err(e) => panic!("{gr:?}: {e}"),
    };
    assert!(refused(Grammar::JsonSchema("{not json".into())).contains("not JSON"));
    let m = refused(Grammar::JsonSchema(
        serde_json::json!({"type": "strin"}).to_string(),
    ));
    assert!(m.contains("strin"), "{m}");
    let m = refused(Grammar::Regex("[a-".into()));
    assert!(!m.is_empty());
    let m = refused(Grammar::Lark("start: missing_rule".into()));
    assert!(m.contains("missing_rule"), "{m}");
    assert!(refused(Grammar::Choice(vec![])).contains("empty"));
    // Schemas with no instance: references that only lead to each other.
    for schema in [
        serde_json::json!({"$ref": "#"}),
        serde_json::json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                           "$ref": "#/$defs/a"}),
        // Infinite-only: every instance must hold another instance.
        serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        serde_json::json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    ] {
        let m = refused(Grammar::JsonSchema(schema.to_string()));
        assert!(
            m.contains("no text a model could write") || m.contains("cannot start"),
            "{m}"
        );
    }
    // A recursive schema with a way out compiles.
    let tree = serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#"}}});
    assert!(g.compile(&Grammar::JsonSchema(tree.to_string())).is_ok());
}

/// Lark rules `r0` .. `r{n}`, each naming the next.
fn lark_chain(n: usize) -> Grammar {
    let mut s = String::from("start: r0\n");
    for i in 0..n {
        s += &format!("r{i}: r{}\n", i + 1);
    }
    Grammar::Lark(s + &format!("r{n}: \"x\"\n"))
}

/// Schema definitions `d0` .. `d{n}`, each `hop` wrapping a `$ref` to the next.
fn ref_chain(n: usize, hop: impl Fn(Value) -> Value) -> Grammar {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            hop(serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)})),
        );
    }
    defs.insert(format!("d{n}"), serde_json::json!({"type": "integer"}));
    Grammar::JsonSchema(serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string())
}

#[test]
fn chains_past_the_depth_limit_are_refused_and_those_within_it_compile() {
    // Each of these overflowed a 2 MiB thread stack (the async workers' and the blocking
    // pool's) at 700 levels or fewer, aborting the process.
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let any_of = |r: Value| serde_json::json!({"anyOf": [r, {"type": "null"}]});
    let nested = |r: Value| serde_json::json!({"type": "object", "properties": {"a": r}});
    let over = [
        lark_chain(700),
        lark_chain(20_000),
        ref_chain(700, |r| r),
        ref_chain(700, any_of),
        ref_chain(5_000, nested),
    ];
    for grammar in &over {
        match g.compile(grammar) {
            Err(GrammarError::Invalid(m)) => {
                assert!(m.contains("levels deep, over the limit of 512"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
    // Just within the limit, the deepest of each kind compiles on the compile threads' stacks
    // and constrains: the first token of the Lark chain's only sentence is `x`.
    let within = [
        lark_chain(MAX_GRAMMAR_DEPTH - 2),
        ref_chain(MAX_GRAMMAR_DEPTH - 4, |r| r),
        ref_chain(MAX_GRAMMAR_DEPTH / 3 - 2, any_of),
        ref_chain(MAX_GRAMMAR_DEPTH / 3 - 2, nested),
    ];
    for grammar in &within {
        let mut c = g
            .compile(grammar)
            .unwrap_or_else(|e| panic!("{e}: {}", &format!("{grammar:?}")[..80]));
        assert!(c.allowed().unwrap().count() > 0);
    }
    let mut c = g.compile(&within[0]).unwrap();
    let x = tok.encode("x", false).unwrap();
    let mask = c.allowed().unwrap();
    assert!(
        mask.allows(x[0]) && mask.count() == 1,
        "only x: {}",
        mask.count()
    );
    // Bigger than the size limit is refused before it is parsed.
    let big = Grammar::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1));
    match g.compile(&big) {
        Err(GrammarError::Invalid(m)) => assert!(m.contains("over the limit"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_constraint_fed_elsewhere_tokens_continues_from_there() {
    // A remote prefill's first token, or a migrated stream's output, replayed into a fresh
    // constraint leaves it where the original one was.
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let grammar = Grammar::Regex("ab+c".into());
    let mut a = g.compile(&grammar).unwrap();
    let prefix = tok.encode("abb", false).unwrap();
    for &t in &prefix {
        a.consume(t).unwrap();
    }
    let mut b = g.compile(&grammar).unwrap();
    for &t in &prefix {
        b.consume(t).unwrap();
    }
    let (ma, mb) = (a.allowed().unwrap(), b.allowed().unwrap());
    assert_eq!(ma.count(), mb.count());
    let c = tok.encode("c", false).unwrap()[0];
    assert!(ma.allows(c) && mb.allows(c));
    let x = tok.encode("x", false).unwrap()[0];
    assert!(!ma.allows(x));
    assert!(matches!(a.consume(x), Err(GrammarError::Rejected(_))));
}

/// A grammar the parser's item limit ends within fifty tokens (see the file).
fn items_bomb() -> Grammar {
    Grammar::Lark(include_str!("data/items_bomb.lark").into())
}

#[test]
fn a_grammar_that_cannot_go_on_says_so() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let mut c = g.compile(&items_bomb()).unwrap();
    let a = tok.encode("a", false).unwrap()[0];
    let mut failed = None;
    for i in 0..100 {
        // Until it fails, `a` is what the grammar allows.
        match c.allowed() {
            Ok(m) => assert!(m.allows(a)),
            Err(e) => {
                failed = Some((i, e));
                break;
            }
        }
        if let Err(e) = c.consume(a) {
            failed = Some((i, e));
            break;
        }
    }
    let (at, e) = failed.expect("the parser's item limit ends it within 100 tokens");
    assert!(at > 10, "{at}");
    assert!(e.to_string().contains("max is 2000"), "{e}");
}

/// A grammar with as many parses as a text can have (`e: e e | "a"`): the parser's work for
/// one token grows with the text (its item limits do not bound it), so a long output ends
/// with the step budget's error (here 20 ms; 1 s by default), or a parser limit, never with
/// steps that take longer and longer while the rest of the batch waits. The walk takes the
/// longest run of `a`s the mask allows each time, so the parse grows fastest.
#[test]
fn a_grammar_of_unbounded_ambiguity_ends_at_the_step_budget() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let ambiguous = Grammar::Lark("start: e\ne: e e | \"a\"\n".into());
    // The vocabulary's runs of `a`, longest first.
    let mut runs: Vec<(usize, u32)> = (1..=16)
        .filter_map(|n| {
            let ids = tok.encode(&"a".repeat(n), false).ok()?;
            (ids.len() == 1).then(|| (n, ids[0]))
        })
        .collect();
    runs.sort_by(|a, b| b.cmp(a));
    assert!(runs.len() >= 2, "{runs:?}");
    let mut c = g
        .compile(&ambiguous)
        .unwrap()
        .with_step_budget(std::time::Duration::from_millis(20));
    let (mut text, mut failed) = (0usize, None);
    for _ in 0..2000 {
        let mask = match c.allowed() {
            Ok(m) => m,
            Err(e) => {
                failed = Some(e);
                break;
            }
        };
        // Every run of `a`s is in the language.
        assert!(runs.iter().all(|&(_, t)| mask.allows(t)));
        let (n, t) = runs[0];
        if let Err(e) = c.consume(t) {
            failed = Some(e);
            break;
        }
        text += n;
    }
    let e = failed.expect("the step budget (or a parser limit) ends it");
    let m = e.to_string();
    assert!(
        matches!(e, GrammarError::Stuck(_))
            && (m.contains("too ambiguous") || m.contains("max is")),
        "{m}"
    );
    assert!(text > 16, "{text} a's before {m}");

    // The budget is checked on every call: none at all fails the first one.
    let mut c = g
        .compile(&ambiguous)
        .unwrap()
        .with_step_budget(std::time::Duration::ZERO);
    let e = c.allowed().err().expect("over a budget of nothing");
    assert!(e.to_string().contains("too ambiguous"), "{e}");
}

/// Speculative decoding's proposals are checked against the grammar without moving it: the
/// tokens the grammar allows in a row from where it stands, and the constraint stays there.
#[test]
fn a_proposal_is_cut_where_it_leaves_the_grammar_and_the_constraint_stays() {
    let (tok, vocab) = tokenizer();
    let g = Grammars::new(&tok, vocab).unwrap();
    let mut c = g.compile(&Grammar::Regex("ab+c".into())).unwrap();
    let ids = |s: &str| tok.encode(s, false).unwrap();
    let (abb, c_, x) = (ids("abb"), ids("c"), ids("x"));
    assert_eq!(
        c.valid_prefix(&[abb.clone(), c_.clone()].concat()),
        abb.len() + c_.len()
    );
    assert_eq!(
        c.valid_prefix(&[abb.clone(), x.clone(), c_.clone()].concat()),
        abb.len()
    );
    assert_eq!(c.valid_prefix(&x), 0);
    // Nothing moved: the text is still to come in full.
    for &t in &abb {
        c.consume(t).unwrap();
    }
    assert_eq!(c.valid_prefix(&[c_.clone(), abb].concat()), c_.len());
}
