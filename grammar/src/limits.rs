//! What a grammar may ask of the compiler, checked before it runs: the grammar engine resolves
//! rule references and schema `$ref`s recursively, so a flat text of a few kilobytes that chains
//! hundreds of them deep would run a thread out of stack. These checks walk the text with
//! explicit stacks (nothing here recurses) and refuse what is too long or too deep with a
//! [`GrammarError::Invalid`] naming the limit.

use std::collections::HashMap;

use serde_json::Value;

use crate::GrammarError;

/// Longest text a grammar (a schema, a regular expression, a Lark grammar, the choices together)
/// may have, in bytes. The grammar engine's own size limit (half a million symbols) comes later;
/// this one bounds the work done before it.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// Deepest chain a grammar may build: Lark rules that each name the next, or schema `$ref`s
/// that each lead to the next, weighted by how deep in its schema each `$ref` sits. Real schemas
/// and grammars stay within a few dozen; the compile threads' stacks hold many times this.
pub const MAX_GRAMMAR_DEPTH: usize = 512;

/// Most JSON values the `$ref` walk may visit: a schema whose references would make it visit
/// more (the same large subtree reached under many names) is refused as too complex.
const MAX_SCHEMA_VISITS: usize = 4_000_000;

pub(crate) fn check_size(what: &str, bytes: usize) -> Result<(), GrammarError> {
    if bytes > MAX_GRAMMAR_BYTES {
        return Err(GrammarError::Invalid(format!(
            "the {what} has {bytes} bytes, over the limit of {MAX_GRAMMAR_BYTES}"
        )));
    }
    Ok(())
}

fn too_deep(what: &str, depth: usize) -> GrammarError {
    GrammarError::Invalid(format!(
        "the {what} chains {depth} levels deep, over the limit of {MAX_GRAMMAR_DEPTH}: \
         flatten its references"
    ))
}

/// The longest weighted path through a graph of `n` nodes whose edges `edges(i)` gives (target,
/// weight), starting anywhere; a node's own weight is `base[i]`. An edge back into the path (a
/// recursive grammar) adds nothing: the compiler meets such a reference as one it is already
/// resolving. Iterative, memoized: each node is finished once.
fn longest_path(base: &[usize], edges: &[Vec<(usize, usize)>]) -> usize {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let n = base.len();
    let mut mark = vec![Mark::New; n];
    let mut best = base.to_vec();
    let mut stack: Vec<(usize, usize)> = Vec::new();
    for root in 0..n {
        if mark[root] != Mark::New {
            continue;
        }
        mark[root] = Mark::Open;
        stack.push((root, 0));
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&(to, _)) = edges[node].get(*next) {
                *next += 1;
                if mark[to] == Mark::New {
                    mark[to] = Mark::Open;
                    stack.push((to, 0));
                }
                continue;
            }
            // Every successor is done or on the path: this node's longest chain is settled.
            let through = edges[node]
                .iter()
                .filter(|&&(to, _)| mark[to] == Mark::Done)
                .map(|&(to, w)| w + best[to])
                .max()
                .unwrap_or(0);
            best[node] = best[node].max(through);
            mark[node] = Mark::Done;
            stack.pop();
        }
    }
    best.into_iter().max().unwrap_or(0)
}

/// Refuses a JSON schema whose `$ref` chains, weighted by the nesting each `$ref` sits under,
/// run deeper than [`MAX_GRAMMAR_DEPTH`].
pub(crate) fn check_schema(schema: &Value) -> Result<(), GrammarError> {
    // Nodes: the document, then each distinct local `$ref` target, in order of discovery.
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut targets: Vec<Option<&Value>> = vec![Some(schema)];
    let mut base = Vec::new();
    let mut edges: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut visits = 0usize;
    let mut node = 0;
    while node < targets.len() {
        let mut own_depth = 0;
        let mut out = Vec::new();
        let mut walk: Vec<(&Value, usize)> = targets[node].map(|v| (v, 1)).into_iter().collect();
        while let Some((v, depth)) = walk.pop() {
            visits += 1;
            if visits > MAX_SCHEMA_VISITS {
                return Err(GrammarError::Invalid(format!(
                    "the JSON schema's references reach more than {MAX_SCHEMA_VISITS} values: \
                     it is too complex to compile"
                )));
            }
            own_depth = own_depth.max(depth);
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        // Remote references are refused by the compiler; local ones are
                        // JSON pointers into this document.
                        if let Some(pointer) = r.strip_prefix('#') {
                            let next = index.len() + 1;
                            let id = *index.entry(pointer.to_string()).or_insert_with(|| {
                                targets.push(schema.pointer(pointer));
                                next
                            });
                            out.push((id, depth));
                        }
                    }
                    walk.extend(o.values().map(|c| (c, depth + 1)));
                }
                Value::Array(a) => walk.extend(a.iter().map(|c| (c, depth + 1))),
                _ => {}
            }
        }
        base.push(own_depth);
        edges.push(out);
        node += 1;
    }
    let depth = longest_path(&base, &edges);
    if depth > MAX_GRAMMAR_DEPTH {
        return Err(too_deep("JSON schema", depth));
    }
    Ok(())
}

/// The rules a Lark grammar defines, each with the names its body mentions: a light lexer that
/// knows where strings, regular expressions and comments are, enough to see which identifiers
/// refer to rules. It over-approximates (a name in a directive counts as a reference), which
/// can only make the measured depth larger.
fn lark_rules(text: &str) -> Vec<(&str, Vec<&str>)> {
    let b = text.as_bytes();
    let ident_start = |c: u8| c.is_ascii_alphabetic() || c == b'_';
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut rules: Vec<(&str, Vec<&str>)> = Vec::new();
    let mut i = 0;
    let mut line_start = true;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line_start = true;
            i += 1;
            continue;
        }
        if line_start {
            line_start = false;
            // A definition starts a line: `name:`, `?name:`, `!name:`, `name.2:`.
            let mut j = i;
            if j < b.len() && (b[j] == b'?' || b[j] == b'!') {
                j += 1;
            }
            if j < b.len() && ident_start(b[j]) {
                let s = j;
                while j < b.len() && ident(b[j]) {
                    j += 1;
                }
                let name = &text[s..j];
                if j < b.len() && b[j] == b'.' {
                    j += 1;
                    while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'-') {
                        j += 1;
                    }
                }
                while j < b.len() && (b[j] == b' ' || b[j] == b'\t') {
                    j += 1;
                }
                if j < b.len() && b[j] == b':' {
                    rules.push((name, Vec::new()));
                    i = j + 1;
                    continue;
                }
            }
        }
        match c {
            b'"' | b'/' => {
                if c == b'/' && b.get(i + 1) == Some(&b'/') {
                    // A comment, to the end of the line.
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                    continue;
                }
                // A string or a regular expression, with backslash escapes.
                i += 1;
                while i < b.len() && b[i] != c && b[i] != b'\n' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                if c == b'/' {
                    // A regular expression's flags.
                    while i < b.len() && b[i].is_ascii_lowercase() {
                        i += 1;
                    }
                }
            }
            c if ident_start(c) => {
                let s = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                if let Some((_, refs)) = rules.last_mut() {
                    refs.push(&text[s..i]);
                }
            }
            _ => i += 1,
        }
    }
    rules
}

/// Refuses a Lark grammar whose rules chain (each naming the next) deeper than
/// [`MAX_GRAMMAR_DEPTH`].
pub(crate) fn check_lark(text: &str) -> Result<(), GrammarError> {
    let rules = lark_rules(text);
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, (name, _)) in rules.iter().enumerate() {
        index.entry(name).or_insert(i);
    }
    let edges: Vec<Vec<(usize, usize)>> = rules
        .iter()
        .map(|(_, refs)| {
            refs.iter()
                .filter_map(|r| index.get(r).map(|&to| (to, 1)))
                .collect()
        })
        .collect();
    let depth = longest_path(&vec![1; rules.len()], &edges);
    if depth > MAX_GRAMMAR_DEPTH {
        return Err(too_deep("Lark grammar", depth));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lark_chain(n: usize) -> String {
        let mut s = String::from("start: r0\n");
        for i in 0..n {
            s += &format!("r{i}: r{}\n", i + 1);
        }
        s + &format!("r{n}: \"x\"\n")
    }

    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert(format!("d{n}"), serde_json::json!({"type": "integer"}));
        serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn lark_chains_are_measured_by_their_longest_path() {
        // start, r0..=r(n): n + 2 rules in one chain.
        assert_eq!(lark_rules(&lark_chain(3)).len(), 5);
        assert!(check_lark(&lark_chain(MAX_GRAMMAR_DEPTH - 2)).is_ok());
        let e = check_lark(&lark_chain(MAX_GRAMMAR_DEPTH - 1)).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("chains {} levels", MAX_GRAMMAR_DEPTH + 1)),
            "{e}"
        );
        // Recursion is not depth: a rule that names itself, or two that name each other.
        assert!(check_lark("start: a\na: \"(\" a \")\" | b\nb: \"x\" a?\n").is_ok());
    }

    #[test]
    fn names_inside_strings_regexes_and_comments_are_not_references() {
        let rules = lark_rules(
            "start: a \"b c\" /d[e]\\/f/i // g h\n  | \"\\\"a\" A\n?a.2 : \"x\"\nA: /[0-9]+/\n%ignore A\n",
        );
        let names: Vec<&str> = rules.iter().map(|r| r.0).collect();
        assert_eq!(names, ["start", "a", "A"]);
        assert_eq!(rules[0].1, ["a", "A"]);
        assert_eq!(rules[1].1, Vec::<&str>::new());
        // The directive's names are counted with the last rule: an over-estimate, never less.
        assert_eq!(rules[2].1, ["ignore", "A"]);
    }

    #[test]
    fn schema_ref_chains_are_weighted_by_nesting() {
        // Each hop's `$ref` sits one level into its definition, the last definition's `type`
        // two; the longest path enters the chain at d1, whose `$ref` the document holds three
        // deep (`$defs`, `d0`, `$ref`): 3 + (n - 1) + 2 = n + 4.
        assert!(check_schema(&ref_chain(MAX_GRAMMAR_DEPTH - 4)).is_ok());
        let e = check_schema(&ref_chain(MAX_GRAMMAR_DEPTH - 3)).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("chains {} levels", MAX_GRAMMAR_DEPTH + 1)),
            "{e}"
        );
        // A `$ref` deep in properties counts that depth (3 per hop here: properties, a, $ref).
        let mut defs = serde_json::Map::new();
        let n = MAX_GRAMMAR_DEPTH / 3 + 2;
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                serde_json::json!({"type": "object", "properties": {"a": {"$ref": format!("#/$defs/d{}", i + 1)}}}),
            );
        }
        defs.insert(format!("d{n}"), serde_json::json!({"type": "integer"}));
        assert!(check_schema(&serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"})).is_err());
        // A recursive schema (a tree) is shallow: its cycle adds nothing.
        let tree = serde_json::json!({
            "$defs": {"node": {"type": "object", "properties": {
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        assert!(check_schema(&tree).is_ok());
        // A reference to nothing is the compiler's to refuse, not this check's.
        assert!(check_schema(&serde_json::json!({"$ref": "#/nowhere"})).is_ok());
    }

    #[test]
    fn a_schema_that_reaches_the_same_subtree_under_many_names_is_refused() {
        // Each pointer into a nest is a node of its own that walks everything below it: 100
        // names for the levels above 50,000 values visit five million.
        let mut nest = Value::Object(
            (0..50_000)
                .map(|i| (format!("k{i}"), Value::from(i)))
                .collect(),
        );
        for _ in 0..100 {
            nest = serde_json::json!({ "x": nest });
        }
        let refs: Vec<Value> = (1..=100)
            .map(|i| serde_json::json!({"$ref": format!("#/$defs/n{}", "/x".repeat(i - 1))}))
            .collect();
        let schema = serde_json::json!({"$defs": {"n": nest}, "anyOf": refs});
        let e = check_schema(&schema).unwrap_err();
        assert!(e.to_string().contains("too complex"), "{e}");
        assert!(check_size("Lark grammar", MAX_GRAMMAR_BYTES).is_ok());
        assert!(check_size("Lark grammar", MAX_GRAMMAR_BYTES + 1).is_err());
    }
}
