//! Whether a JSON schema has any finite instance, checked before it is compiled: a schema whose
//! every instance must hold another instance of itself (`$ref` cycles through required
//! properties or non-empty arrays) describes no text a model could ever finish, and the grammar
//! engine compiles it anyway.
//!
//! The least fixpoint of "has a finite instance" over the schema's local `$ref` targets, each
//! keyword read as an over-approximation (a schema is refused only when it certainly has no
//! finite instance): scalar types, `enum`, `const`, `not` and keywords this check does not model
//! count as satisfiable; an object needs each required property's schema satisfiable, an array
//! of `minItems` ≥ 1 its item schema; `anyOf`/`oneOf` need one branch, `allOf` every one, a
//! `$ref` its target. Walks are bounded (the size and depth limits were checked first); a schema
//! too large to settle within the budget is given the benefit of the doubt.

use std::collections::HashMap;

use serde_json::Value;

/// Schema nodes evaluated, over every round of the fixpoint, before the check gives up (and
/// lets the schema through).
const BUDGET: usize = 4_000_000;

struct Finite<'a> {
    root: &'a Value,
    /// Local `$ref` pointers (without the leading `#`) and whether their target has a finite
    /// instance, as far as the fixpoint has got.
    refs: HashMap<String, bool>,
    visits: usize,
}

impl<'a> Finite<'a> {
    /// Whether `v` has a finite instance, reading `$ref`s from the current assumptions (and
    /// registering targets seen for the first time as not yet shown satisfiable).
    fn sat(&mut self, v: &'a Value) -> Option<bool> {
        self.visits += 1;
        if self.visits > BUDGET {
            return None;
        }
        let o = match v {
            Value::Bool(b) => return Some(*b),
            Value::Object(o) => o,
            _ => return Some(true),
        };
        if let Some(Value::String(r)) = o.get("$ref") {
            if let Some(pointer) = r.strip_prefix('#') {
                if self.root.pointer(pointer).is_some() {
                    let known = *self.refs.entry(pointer.to_string()).or_insert(false);
                    if !known {
                        return Some(false);
                    }
                }
            }
        }
        if let Some(Value::Array(all)) = o.get("allOf") {
            for s in all {
                if !self.sat(s)? {
                    return Some(false);
                }
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(any)) = o.get(key) {
                let mut one = false;
                for s in any {
                    if self.sat(s)? {
                        one = true;
                        break;
                    }
                }
                if !one {
                    return Some(false);
                }
            }
        }
        // The instance types the schema allows: one of them must have a finite instance.
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => vec!["any"],
        };
        for t in types {
            let ok = match t {
                "object" => self.object(o)?,
                "array" => self.array(o)?,
                // Scalars, and no type at all (a scalar instance ignores the object and array
                // keywords), always have one.
                _ => true,
            };
            if ok {
                return Some(true);
            }
        }
        Some(false)
    }

    fn object(&mut self, o: &'a serde_json::Map<String, Value>) -> Option<bool> {
        let Some(Value::Array(required)) = o.get("required") else {
            return Some(true);
        };
        let props = o.get("properties").and_then(Value::as_object);
        for name in required.iter().filter_map(Value::as_str) {
            // A required property the schema says nothing of may hold anything.
            if let Some(s) = props.and_then(|p| p.get(name)) {
                if !self.sat(s)? {
                    return Some(false);
                }
            }
        }
        Some(true)
    }

    fn array(&mut self, o: &'a serde_json::Map<String, Value>) -> Option<bool> {
        let min = o.get("minItems").and_then(Value::as_u64).unwrap_or(0) as usize;
        if min == 0 {
            return Some(true);
        }
        let prefix = o.get("prefixItems").and_then(Value::as_array);
        for i in 0..min {
            let item = match prefix.and_then(|p| p.get(i)) {
                Some(s) => s,
                None => match o.get("items") {
                    Some(s) => s,
                    None => return Some(true),
                },
            };
            if !self.sat(item)? {
                return Some(false);
            }
            // Past the prefix every item has the same schema: one check covers the rest.
            if prefix.is_none_or(|p| i >= p.len()) {
                break;
            }
        }
        Some(true)
    }
}

/// Whether `schema` has a finite instance: `Some(false)` only when it certainly has none;
/// `None` when the check ran out of budget.
pub(crate) fn has_finite_instance(schema: &Value) -> Option<bool> {
    let mut f = Finite {
        root: schema,
        refs: HashMap::new(),
        visits: 0,
    };
    // Rounds until no target changes and none is newly found: a round can only turn targets
    // from unknown to satisfiable, or find new ones, so the rounds are bounded by the targets.
    loop {
        let root = f.sat(schema)?;
        let known = f.refs.len();
        let targets: Vec<String> = f.refs.keys().cloned().collect();
        let mut changed = false;
        for t in targets {
            if f.refs[&t] {
                continue;
            }
            let target = schema.pointer(&t).expect("registered targets resolve");
            if f.sat(target)? {
                f.refs.insert(t, true);
                changed = true;
            }
        }
        if !changed && f.refs.len() == known {
            return Some(root);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Definitions `d0` .. `d{n}`, each a `$ref` to the next; the last an integer, or (`loop`)
    /// a reference back to `d0`.
    fn chain(n: usize, last: &str) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        let end = match last {
            "integer" => json!({"type": "integer"}),
            _ => json!({"$ref": "#/$defs/d0"}),
        };
        defs.insert(format!("d{n}"), end);
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn infinite_only_schemas_are_found_and_recursive_ones_with_a_way_out_are_not() {
        for (schema, finite) in [
            (json!({"type": "integer"}), true),
            (json!(true), true),
            (json!(false), false),
            (json!({"$ref": "#"}), false),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
                true,
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                false,
            ),
            // Without a type, a scalar instance ignores the required property.
            (
                json!({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                true,
            ),
            (
                json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
                false,
            ),
            (json!({"type": "array", "items": {"$ref": "#"}}), true),
            (
                json!({"type": ["array", "null"], "items": {"$ref": "#"}, "minItems": 1}),
                true,
            ),
            (
                json!({"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}],
                       "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#"}},
                                       "required": ["x"]}}}),
                true,
            ),
            (
                json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "object",
                        "properties": {"n": {"$ref": "#/$defs/a"}}, "required": ["n"]}},
                       "$ref": "#/$defs/a"}),
                false,
            ),
            // A list whose next link is optional: finite.
            (
                json!({"$defs": {"node": {"type": "object", "properties": {
                        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                        "required": ["v"]}}, "$ref": "#/$defs/node"}),
                true,
            ),
            // A prefix item that recurses, behind a required first element.
            (
                json!({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}),
                false,
            ),
            (json!({"allOf": [{"type": "string"}, {"$ref": "#"}]}), false),
            (json!({"oneOf": [{"$ref": "#"}, {"type": "string"}]}), true),
            // A chain of references found one round at a time, ending in an integer.
            (chain(700, "integer"), true),
            (chain(700, "loop"), false),
        ] {
            assert_eq!(has_finite_instance(&schema), Some(finite), "{schema}");
        }
    }
}
