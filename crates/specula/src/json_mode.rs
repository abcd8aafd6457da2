//! Constrained JSON output (OpenAI's `response_format`): `json_object` (one JSON object) and `json_schema` (one
//! object that matches a JSON Schema, in the subset [`JsonGrammar::from_schema`] lists). The same machinery
//! constrains output to a regex or a list of choices ([`JsonGrammar::from_regex`], [`JsonGrammar::from_choices`]:
//! a bare text, no JSON around it).
//!
//! A schema compiles to a small grammar ([`JsonGrammar`]): objects with their properties, arrays (tuples too),
//! strings, numbers, values a byte DFA shapes (patterns, formats, numeric bounds), fixed texts (`enum`, `const`,
//! booleans, null) and unions. A byte-level automaton walks it: a path is a stack of frames, one for each
//! container open and one for the value being written, and its state ([`JsonState`], `Copy`) holds one path, or
//! several where a union's alternatives began alike (pydantic's `Union[Cat, Dog]`: two objects) until the bytes
//! tell them apart. It accepts exactly the prefixes of `ws* value` for the grammar's root (RFC 8259
//! syntax; strings may hold any byte of 0x20 and up, so a token may end inside a UTF-8 character). Before each token
//! is chosen, every token whose bytes would leave that language gets a logit of minus infinity; stop tokens are
//! allowed only once the value is complete, and then only they are. The mask is a logit adjustment like the
//! penalties (decode/generation.rs), applied to each verify row after the draft tokens it follows, so speculation
//! stays lossless against plain decoding; drafters propose without it and lose only acceptance.
//!
//! A mask depends only on the grammar and the path; [`JsonConstraint`] computes each path's mask once (a pass
//! over the tokens whose first byte the path takes) and keeps it for every request that shares the constraint; a
//! state of several paths allows the tokens any of them allows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

mod byte_dfa;
mod value_regex;

/// The string `format`s a schema may ask for.
pub use value_regex::FORMATS;

use byte_dfa::ByteDfa;

/// Frames a state holds at most: each open container takes one, and so does a scalar being written (so at most
/// `MAX_DEPTH` containers are open at once, the innermost of them then empty).
pub const MAX_DEPTH: usize = 32;
/// Whitespace bytes in a row, at most: JSON allows any number, and a model that starts emitting blank lines
/// inside a constrained object may never stop.
pub const MAX_WHITESPACE_RUN: u8 = 64;
/// Paths a state follows at once: alternatives of a union that begin alike (two objects) are each followed until
/// the bytes tell them apart. A schema whose union begins more alike is refused; where nested unions would make
/// more, the first ones in the schema's order are kept (the output still matches; only some of its choices go).
pub const MAX_PATHS: usize = 8;
/// States whose masks a constraint keeps (about vocabulary / 8 bytes each: 19 KB for Qwen's 151,936 tokens).
const MASK_CACHE_STATES: usize = 512;
/// Grammar nodes a schema may compile to.
const MAX_NODES: usize = 4096;
/// Length bounds up to this are built into a string's automaton (beyond, its frame counts characters).
const MAX_COUNTED_IN_DFA: u32 = 256;
/// Different automata (patterns, formats, bounds) a schema may need.
const MAX_DFAS: usize = 64;
/// Automaton states a schema's automata hold together (512 bytes each: 16 MiB), so that a request's schema cannot
/// make the server keep hundreds of megabytes (it keeps 32 schemas' constraints).
const MAX_DFA_STATES: usize = 32_768;
/// Choices a `guided_choice` list may hold.
pub const MAX_CHOICES: usize = 1024;
/// Counts (string characters, array items) saturate here: a bound at or above it is no bound.
const COUNT_LIMIT: u32 = u16::MAX as u32;

type NodeId = u16;

/// A value the grammar allows.
#[derive(Debug, Clone)]
enum Node {
    Object(ObjectNode),
    /// An array: item i of `prefix` (a tuple's positions), then `items` for the rest.
    Array {
        prefix: Vec<NodeId>,
        items: NodeId,
        min: u32,
        max: u32,
        /// `uniqueItems` (items are then fixed texts, at most 16: the array's frame keeps a bit per text written).
        unique: bool,
    },
    /// A string of `min..=max` characters (a character: a UTF-8 sequence or a JSON escape).
    String {
        min: u32,
        max: u32,
    },
    Number {
        integer: bool,
    },
    /// A string (`quoted`) or a number whose text the automaton `dfa` (an index into the grammar's) takes whole:
    /// a `pattern` or `format`, bounds, `multipleOf`.
    Matched {
        dfa: u16,
        quoted: bool,
        /// Characters a string must have, counted in its frame where the automaton does not count them itself
        /// (a bound too long for the product: `maxLength` 2083 on a `uri`); 0 and COUNT_LIMIT otherwise.
        min: u32,
        max: u32,
    },
    /// One of a few fixed JSON texts (`enum`, `const`, booleans, null): a trie of their bytes.
    Literals(Trie),
    /// One of several nodes. The value's first byte picks one; where it begins several alike (two objects),
    /// the state follows each as a path of its own until the bytes tell them apart (at most `MAX_PATHS`).
    Union {
        alts: Vec<NodeId>,
        /// `oneOf`: exactly one alternative may match, so those that begin alike must exclude one another.
        one_of: bool,
        /// Where in the schema (for errors found once the grammar is whole).
        at: Box<str>,
    },
    /// Reserved while a `$ref` is being compiled; never left in a finished grammar.
    Pending,
}

#[derive(Debug, Clone)]
struct ObjectNode {
    /// Listed properties, written in this order (optional ones may be left out).
    props: Vec<NodeId>,
    /// `next_required[i]`: the first required property at or after i (`props.len()` where none is).
    next_required: Vec<u16>,
    /// The listed keys as JSON strings (quotes included); each key's end names its property.
    keys: Trie,
    /// With no properties listed: any key, with values of this node (None: the object must be empty).
    any_keys: Option<NodeId>,
    /// `propertyNames` (or a `patternProperties` pattern): the string node such keys are read with (None: any
    /// string). Listed keys are checked against it when the grammar is built.
    key: Option<NodeId>,
    /// `additionalProperties: false`: a key not listed makes a value fail the schema (a union's alternatives
    /// exclude one another by it).
    closed: bool,
    /// `minProperties` / `maxProperties` (0 and COUNT_LIMIT where absent). Properties written are counted in the
    /// frame: `count` for any keys, `sub` for listed ones (whose `count` is the next property).
    min: u32,
    max: u32,
    /// `required_after[i]`: the required properties at or after i.
    required_after: Vec<u16>,
}

impl ObjectNode {
    /// Whether the object may end with `written` properties, the next listed one not yet written being `next`.
    fn may_close(&self, next: u16, written: u32) -> bool {
        written >= self.min
            && (self.any_keys.is_some()
                || self.next_required[next as usize] as usize == self.props.len())
    }

    /// The listed properties a key may name, with `written` properties written and the next one not yet written
    /// being `next` (None: no key may follow): up to the first required one; only that one where an optional key
    /// would leave no room within `max` for the required ones; and none so far on that `min` could no longer be
    /// reached with the properties after it.
    fn key_range(&self, next: u16, written: u32) -> Option<(u16, u16)> {
        let len = self.props.len() as u32;
        if written >= self.max || next as u32 >= len {
            return None;
        }
        let first_required = self.next_required[next as usize];
        let mut lo = next;
        let mut hi = first_required.min(len as u16 - 1);
        if written + 1 + self.required_after[next as usize] as u32 > self.max {
            if first_required as u32 == len {
                return None;
            }
            lo = first_required;
        }
        if self.min > written {
            hi = hi.min((len + written - self.min) as u16);
        }
        (lo <= hi).then_some((lo, hi))
    }

    /// Whether a key may follow in an object of any keys with `written` written.
    fn takes_another_key(&self, written: u32) -> bool {
        written < self.max
    }
}

/// A byte trie; node 0 is the root.
#[derive(Debug, Clone, Default)]
struct Trie {
    nodes: Vec<TrieNode>,
    /// The texts, by index.
    texts: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, Default)]
struct TrieNode {
    children: Vec<(u8, u16)>,
    /// The text that ends here.
    end: Option<u16>,
    /// Every text that ends here or below, sorted.
    below: Vec<u16>,
}

impl Trie {
    fn new(texts: &[Vec<u8>]) -> Result<Trie> {
        let mut trie = Trie {
            nodes: vec![TrieNode::default()],
            texts: texts.to_vec(),
        };
        for (i, text) in texts.iter().enumerate() {
            let mut at = 0usize;
            trie.nodes[0].below.push(i as u16);
            for &b in text {
                at = match trie.child(at as u16, b) {
                    Some(c) => c as usize,
                    None => {
                        if trie.nodes.len() >= u16::MAX as usize {
                            return Err(schema_error("its keys and enum values are too long"));
                        }
                        trie.nodes.push(TrieNode::default());
                        let c = trie.nodes.len() - 1;
                        trie.nodes[at].children.push((b, c as u16));
                        c
                    }
                };
                trie.nodes[at].below.push(i as u16);
            }
            // Duplicate texts keep the first index.
            trie.nodes[at].end.get_or_insert(i as u16);
        }
        Ok(trie)
    }

    fn child(&self, node: u16, b: u8) -> Option<u16> {
        self.nodes[node as usize]
            .children
            .iter()
            .find(|&&(c, _)| c == b)
            .map(|&(_, n)| n)
    }

    fn end(&self, node: u16) -> Option<u16> {
        self.nodes[node as usize].end
    }

    /// Whether a text not in `used` (a bit per text index) ends at or below `node`.
    fn leads_to_unused(&self, node: u16, used: u16) -> bool {
        self.nodes[node as usize]
            .below
            .iter()
            .any(|&i| i >= 16 || used >> i & 1 == 0)
    }

    /// Whether a text with an index in `lo..=hi` ends at or below `node`.
    fn leads_to(&self, node: u16, (lo, hi): (u16, u16)) -> bool {
        let below = &self.nodes[node as usize].below;
        let i = below.partition_point(|&t| t < lo);
        i < below.len() && below[i] <= hi
    }
}

/// A compiled output grammar: what [`JsonState`] walks. Node 0 is the root, always an object.
#[derive(Debug, Clone)]
pub struct JsonGrammar {
    nodes: Vec<Node>,
    /// The bytes each node's values may begin with (a union's first byte picks its alternative).
    first: Vec<ByteSet>,
    /// The automata of `Node::Matched` values.
    dfas: Vec<ByteDfa>,
    /// Where a union's first byte begins several alternatives alike: those alternatives (never unions).
    forks: HashMap<(NodeId, u8), Box<[NodeId]>>,
    /// Unions with an entry in `forks` (so that the others skip the lookup).
    forking: Vec<bool>,
    /// The output is a bare text its root automaton matches (a regex or a list of choices, not JSON): no
    /// whitespace before it, and it may end wherever the automaton accepts.
    bare: bool,
}

/// `text` as a regex that matches exactly it (every character the regex syntax gives a meaning escaped).
fn regex_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn schema_error(msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("json_schema: {msg}"))
}

/// Keywords that describe a schema without constraining its values.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
    // OpenAPI's (pydantic writes it beside a oneOf): its alternatives' own `const` properties say the same, and
    // those are enforced.
    "discriminator",
];

/// Keywords the compiler enforces.
const ENFORCED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "prefixItems",
    "additionalItems",
    "uniqueItems",
    "propertyNames",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];

/// Bytes a string's text may hold as they are (others need escapes, which strings shaped by an automaton do
/// not write: their text is then their value).
fn plain_string_byte(b: u8) -> bool {
    b >= 0x20 && b != b'"' && b != b'\\'
}

/// Bounds a number's bound may have here (whole numbers up to 2^53 are exact in a JSON parser's f64).
const MAX_BOUND: f64 = 9_007_199_254_740_992.0;

struct Compiler<'a> {
    document: &'a Value,
    nodes: Vec<Node>,
    /// Automata of `Node::Matched`, and the index of each by the text that describes it.
    dfas: Vec<ByteDfa>,
    dfa_ids: HashMap<String, u16>,
    refs: HashMap<String, NodeId>,
    any: Option<NodeId>,
    /// Schemas being compiled inside one another (nesting and `$ref` chains), bounded by `MAX_SCHEMA_DEPTH` so
    /// that a request's schema cannot exhaust a server thread's stack.
    depth: usize,
}

/// Schemas nested inside one another (through properties, items, unions or `$ref` chains), at most.
const MAX_SCHEMA_DEPTH: usize = 64;

impl<'a> Compiler<'a> {
    fn reserve(&mut self) -> Result<NodeId> {
        if self.nodes.len() >= MAX_NODES {
            return Err(schema_error(format!(
                "the schema needs more than {MAX_NODES} grammar nodes"
            )));
        }
        self.nodes.push(Node::Pending);
        Ok((self.nodes.len() - 1) as NodeId)
    }

    fn add(&mut self, node: Node) -> Result<NodeId> {
        let id = self.reserve()?;
        self.nodes[id as usize] = node;
        Ok(id)
    }

    /// Any JSON value: one node a grammar, built on first use.
    fn any(&mut self) -> Result<NodeId> {
        if let Some(id) = self.any {
            return Ok(id);
        }
        let id = self.reserve()?;
        self.any = Some(id);
        let object = self.add(Node::Object(ObjectNode {
            props: Vec::new(),
            next_required: vec![0],
            keys: Trie::new(&[])?,
            any_keys: Some(id),
            key: None,
            closed: false,
            min: 0,
            max: COUNT_LIMIT,
            required_after: vec![0],
        }))?;
        let array = self.add(Node::Array {
            prefix: Vec::new(),
            unique: false,
            items: id,
            min: 0,
            max: COUNT_LIMIT,
        })?;
        let string = self.add(Node::String {
            min: 0,
            max: COUNT_LIMIT,
        })?;
        let number = self.add(Node::Number { integer: false })?;
        let literals = self.add(Node::Literals(Trie::new(&[
            b"true".to_vec(),
            b"false".to_vec(),
            b"null".to_vec(),
        ])?))?;
        self.nodes[id as usize] = Node::Union {
            alts: vec![object, array, string, number, literals],
            one_of: false,
            at: "any value".into(),
        };
        Ok(id)
    }

    fn compile(&mut self, schema: &Value, at: &str) -> Result<NodeId> {
        if self.depth >= MAX_SCHEMA_DEPTH {
            return Err(schema_error(format!(
                "{at} is nested more than {MAX_SCHEMA_DEPTH} schemas deep"
            )));
        }
        self.depth += 1;
        let compiled = self.compile_nested(schema, at);
        self.depth -= 1;
        compiled
    }

    fn compile_nested(&mut self, schema: &Value, at: &str) -> Result<NodeId> {
        let map = match schema {
            Value::Bool(true) => return self.any(),
            Value::Bool(false) => {
                return Err(schema_error(format!("{at} is `false`: nothing matches it")))
            }
            Value::Object(map) => map,
            _ => {
                return Err(schema_error(format!(
                    "{at} must be a schema object, got {schema}"
                )))
            }
        };
        for key in map.keys() {
            if !ANNOTATIONS.contains(&key.as_str()) && !ENFORCED.contains(&key.as_str()) {
                return Err(schema_error(format!(
                    "keyword {key:?} at {at} is not supported (supported: {})",
                    ENFORCED.join(", ")
                )));
            }
        }
        let constraining = |except: &[&str]| {
            map.keys()
                .find(|k| ENFORCED.contains(&k.as_str()) && !except.contains(&k.as_str()))
                .cloned()
        };
        if let Some(target) = map.get("$ref") {
            if let Some(other) = constraining(&["$ref"]) {
                return Err(schema_error(format!(
                    "{at} combines $ref with {other:?}, which is not supported"
                )));
            }
            let target = target
                .as_str()
                .ok_or_else(|| schema_error(format!("{at}.$ref must be a string")))?;
            return self.reference(target, at);
        }
        for union in ["anyOf", "oneOf", "allOf"] {
            let Some(list) = map.get(union) else {
                continue;
            };
            if let Some(other) = constraining(&[union]) {
                return Err(schema_error(format!(
                    "{at} combines {union} with {other:?}, which is not supported"
                )));
            }
            let list = list
                .as_array()
                .filter(|l| !l.is_empty())
                .ok_or_else(|| schema_error(format!("{at}.{union} must be a non-empty list")))?;
            if union == "allOf" && list.len() > 1 {
                return Err(schema_error(format!(
                    "{at}.allOf lists {} schemas; only one is supported",
                    list.len()
                )));
            }
            let id = self.reserve()?;
            let mut alternatives = Vec::with_capacity(list.len());
            for (i, s) in list.iter().enumerate() {
                alternatives.push(self.compile(s, &format!("{at}.{union}[{i}]"))?);
            }
            self.nodes[id as usize] = Node::Union {
                alts: alternatives,
                one_of: union == "oneOf",
                at: format!("{at}.{union}").into(),
            };
            return Ok(id);
        }
        if let Some(values) = map.get("enum").or(map.get("const")) {
            let values: Vec<&Value> = match (map.get("enum"), values) {
                (Some(_), Value::Array(list)) if !list.is_empty() => list.iter().collect(),
                (Some(_), _) => {
                    return Err(schema_error(format!("{at}.enum must be a non-empty list")))
                }
                (None, v) => vec![v],
            };
            let texts: Vec<Vec<u8>> = values
                .iter()
                .map(|v| serde_json::to_vec(v).expect("a JSON value serializes"))
                .collect();
            return self.add(Node::Literals(Trie::new(&texts)?));
        }
        let types: Vec<&str> = match map.get("type") {
            None if map.contains_key("properties") || map.contains_key("additionalProperties") => {
                vec!["object"]
            }
            None if map.contains_key("items") => vec!["array"],
            None => return self.any(),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(list)) if !list.is_empty() => list
                .iter()
                .map(|t| {
                    t.as_str().ok_or_else(|| {
                        schema_error(format!("{at}.type lists {t}, not a type name"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(t) => {
                return Err(schema_error(format!(
                    "{at}.type must be a type name or a list of them, got {t}"
                )))
            }
        };
        if types.len() == 1 {
            return self.typed(types[0], map, at);
        }
        let id = self.reserve()?;
        let mut alternatives = Vec::with_capacity(types.len());
        for t in types {
            alternatives.push(self.typed(t, map, at)?);
        }
        self.nodes[id as usize] = Node::Union {
            alts: alternatives,
            one_of: false,
            at: format!("{at}.type").into(),
        };
        Ok(id)
    }

    fn reference(&mut self, target: &str, at: &str) -> Result<NodeId> {
        if let Some(&id) = self.refs.get(target) {
            return Ok(id);
        }
        let pointer = target.strip_prefix('#').ok_or_else(|| {
            schema_error(format!(
                "{at}.$ref {target:?} is not supported: only references inside the schema (\"#/$defs/...\")"
            ))
        })?;
        let document = self.document;
        let schema = document.pointer(pointer).ok_or_else(|| {
            schema_error(format!(
                "{at}.$ref {target:?} points at nothing in the schema"
            ))
        })?;
        // An alias (a union of one) so that references may be recursive.
        let id = self.reserve()?;
        self.refs.insert(target.to_string(), id);
        let inner = self.compile(schema, target)?;
        self.nodes[id as usize] = Node::Union {
            alts: vec![inner],
            one_of: false,
            at: target.into(),
        };
        Ok(id)
    }

    /// The automaton `key` describes, built by `build` the first time (errors name the schema position).
    fn dfa(
        &mut self,
        key: String,
        at: &str,
        build: impl FnOnce(()) -> std::result::Result<ByteDfa, String>,
    ) -> Result<u16> {
        if let Some(&id) = self.dfa_ids.get(&key) {
            return Ok(id);
        }
        if self.dfas.len() >= MAX_DFAS {
            return Err(schema_error(format!(
                "{at}: the schema shapes more than {MAX_DFAS} different values by pattern, format or bounds"
            )));
        }
        let dfa = build(()).map_err(|e| schema_error(format!("{at} cannot be enforced: {e}")))?;
        let states: usize = self.dfas.iter().map(ByteDfa::states).sum::<usize>() + dfa.states();
        if states > MAX_DFA_STATES {
            return Err(schema_error(format!(
                "{at}: the schema's patterns, formats and bounds need more than {MAX_DFA_STATES} automaton states \
                 together ({states})"
            )));
        }
        let id = self.dfas.len() as u16;
        self.dfas.push(dfa);
        self.dfa_ids.insert(key, id);
        Ok(id)
    }

    /// How many fixed texts a node is (through aliases), None for any other node.
    fn literal_count(&self, mut id: NodeId) -> Option<u32> {
        for _ in 0..=self.nodes.len() {
            match &self.nodes[id as usize] {
                Node::Union { alts, .. } if alts.len() == 1 => id = alts[0],
                Node::Literals(trie) => return Some(trie.nodes[0].below.len() as u32),
                _ => return None,
            }
        }
        None
    }

    /// A bound keyword's value (`minimum` with `exclusiveMinimum`, or the maximums): the tighter one, as
    /// (value, exclusive); `exclusive*` may also be draft 4's boolean that makes the plain bound exclusive.
    fn bound(
        map: &serde_json::Map<String, Value>,
        (plain, exclusive): (&str, &str),
        lower: bool,
        at: &str,
    ) -> Result<Option<(f64, bool)>> {
        let number = |key: &str, v: &Value| {
            v.as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| schema_error(format!("{at}.{key} must be a number, got {v}")))
        };
        let mut bound = match map.get(plain) {
            None => None,
            Some(v) => Some((number(plain, v)?, false)),
        };
        match map.get(exclusive) {
            None | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => match &mut bound {
                Some(b) => b.1 = true,
                None => {
                    return Err(schema_error(format!(
                        "{at}.{exclusive} is true but {at}.{plain} is missing"
                    )))
                }
            },
            Some(v) => {
                let x = number(exclusive, v)?;
                let tighter = match bound {
                    None => true,
                    Some((b, _)) => (lower && x >= b) || (!lower && x <= b),
                };
                if tighter {
                    bound = Some((x, true));
                }
            }
        }
        Ok(bound)
    }

    /// For a number or integer with bounds or `multipleOf`: regexes its texts must all match (an integer's
    /// range; or a plain number, each decimal bound, the fraction digits a `multipleOf` 10^-k allows) and a
    /// whole number they must be multiples of; None where it has neither.
    fn number_regex(
        integer: bool,
        map: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<Option<(Vec<String>, Option<u64>)>> {
        let lo = Self::bound(map, ("minimum", "exclusiveMinimum"), true, at)?;
        let hi = Self::bound(map, ("maximum", "exclusiveMaximum"), false, at)?;
        let multiple = match map.get("multipleOf") {
            None => None,
            Some(v) => {
                let m = v
                    .as_f64()
                    .filter(|m| m.is_finite() && *m > 0.0)
                    .ok_or_else(|| {
                        schema_error(format!("{at}.multipleOf must be a number above 0, got {v}"))
                    })?;
                if m > MAX_BOUND {
                    return Err(schema_error(format!(
                        "{at}.multipleOf {v} is not supported (at most 2^53)"
                    )));
                }
                Some(m)
            }
        };
        if lo.is_none() && hi.is_none() && multiple.is_none() {
            return Ok(None);
        }
        for (key, b) in [("minimum", lo), ("maximum", hi)] {
            if let Some((x, _)) = b {
                if x.abs() > MAX_BOUND {
                    return Err(schema_error(format!(
                        "{at}: a {key} of {x} is not supported (at most 2^53 either way)"
                    )));
                }
            }
        }
        // Fraction digits a number may have: multipleOf 10^-k allows k; a whole multipleOf makes it an integer.
        let mut digits = None;
        let mut whole_multiple = None;
        let mut whole = integer;
        if let Some(m) = multiple {
            if m.fract() == 0.0 {
                whole = true;
                if m > 1.0 {
                    whole_multiple = Some(m as u64);
                }
            } else if integer {
                return Err(schema_error(format!(
                    "{at}.multipleOf {m} is not supported for an integer (a whole number is)"
                )));
            } else {
                let k = (1..=12).find(|&k| (m * 10f64.powi(k) - 1.0).abs() < 1e-9);
                match k {
                    Some(k) => digits = Some(k as u32),
                    None => {
                        return Err(schema_error(format!(
                            "{at}.multipleOf {m} is not supported for a number (a whole number or 0.1, 0.01, ... is)"
                        )))
                    }
                }
            }
        }
        if whole {
            // Integers: a fractional bound rounds inward and becomes inclusive.
            let lo = lo.map(|(x, excl)| {
                if x.fract() == 0.0 {
                    (x as i64, excl)
                } else {
                    (x.ceil() as i64, false)
                }
            });
            let hi = hi.map(|(x, excl)| {
                if x.fract() == 0.0 {
                    (x as i64, excl)
                } else {
                    (x.floor() as i64, false)
                }
            });
            let regex = value_regex::integer_range(lo, hi).ok_or_else(|| {
                schema_error(format!(
                    "{at}: no number lies within its minimum and maximum"
                ))
            })?;
            return Ok(Some((vec![regex], whole_multiple)));
        }
        // Numbers: the texts of plain numbers, on the allowed side of each bound, with at most `digits` fraction
        // digits (the automata intersect).
        let mut regexes = vec![value_regex::PLAIN_NUMBER.to_string()];
        for (key, b, lower) in [("minimum", lo, true), ("maximum", hi, false)] {
            if let Some((x, excl)) = b {
                regexes.push(
                    value_regex::decimal_bound(x, lower, excl)
                        .map_err(|e| schema_error(format!("{at}.{key}: {e}")))?,
                );
            }
        }
        if let Some(k) = digits {
            regexes.push(value_regex::fraction_digits(k));
        }
        Ok(Some((regexes, None)))
    }

    fn count(map: &serde_json::Map<String, Value>, key: &str, at: &str) -> Result<Option<u32>> {
        match map.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n.min(COUNT_LIMIT as u64) as u32))
                .ok_or_else(|| schema_error(format!("{at}.{key} must be a whole number, got {v}"))),
        }
    }

    fn bounds(
        map: &serde_json::Map<String, Value>,
        (min_key, max_key): (&str, &str),
        at: &str,
    ) -> Result<(u32, u32)> {
        let min = Self::count(map, min_key, at)?.unwrap_or(0);
        let max = Self::count(map, max_key, at)?.unwrap_or(COUNT_LIMIT);
        if min > max {
            return Err(schema_error(format!(
                "{at}: {min_key} {min} is above {max_key} {max}"
            )));
        }
        Ok((min, max))
    }

    fn typed(
        &mut self,
        kind: &str,
        map: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<NodeId> {
        match kind {
            "null" => self.add(Node::Literals(Trie::new(&[b"null".to_vec()])?)),
            "boolean" => self.add(Node::Literals(Trie::new(&[
                b"true".to_vec(),
                b"false".to_vec(),
            ])?)),
            "integer" | "number" => match Self::number_regex(kind == "integer", map, at)? {
                None => self.add(Node::Number {
                    integer: kind == "integer",
                }),
                Some((regexes, multiple)) => {
                    let key = format!("number {regexes:?} {multiple:?}");
                    let dfa = self.dfa(key, at, |_| {
                        let mut dfa = ByteDfa::from_regex(&regexes[0], |_| true)?;
                        for regex in &regexes[1..] {
                            dfa = dfa.intersect(&ByteDfa::from_regex(regex, |_| true)?)?;
                        }
                        if let Some(m) = multiple {
                            dfa = dfa.intersect(&ByteDfa::multiples_of(m)?)?;
                        }
                        Ok(dfa)
                    })?;
                    self.add(Node::Matched {
                        dfa,
                        quoted: false,
                        min: 0,
                        max: COUNT_LIMIT,
                    })
                }
            },
            "string" => {
                let (min, max) = Self::bounds(map, ("minLength", "maxLength"), at)?;
                let pattern = match map.get("pattern") {
                    None => None,
                    Some(Value::String(p)) => Some(value_regex::pattern(p).map_err(|e| {
                        schema_error(format!("{at}.pattern {p:?} is not supported: {e}"))
                    })?),
                    Some(p) => {
                        return Err(schema_error(format!("{at}.pattern must be a string, got {p}")))
                    }
                };
                let format = match map.get("format") {
                    None => None,
                    Some(Value::String(f)) => Some(value_regex::format(f).ok_or_else(|| {
                        schema_error(format!(
                            "{at}.format {f:?} is not supported (supported: {})",
                            value_regex::FORMATS.join(", ")
                        ))
                    })?),
                    Some(f) => {
                        return Err(schema_error(format!("{at}.format must be a string, got {f}")))
                    }
                };
                if pattern.is_none() && format.is_none() {
                    return self.add(Node::String { min, max });
                }
                let shape = || -> std::result::Result<ByteDfa, String> {
                    let mut dfa: Option<ByteDfa> = None;
                    for regex in pattern.iter().chain(format.iter()) {
                        let next = ByteDfa::from_regex(regex, plain_string_byte)?;
                        dfa = Some(match dfa {
                            None => next,
                            Some(d) => d.intersect(&next)?,
                        });
                    }
                    Ok(dfa.expect("a pattern or a format"))
                };
                let bounded = min > 0 || max < COUNT_LIMIT;
                // Length bounds join the automaton where the product stays small (then no state is a dead end);
                // else the frame counts characters, and a byte is taken only where the value can still be
                // finished within `max` (`ByteDfa::chars_left`), and `min` must hold for every value it takes.
                let product = if bounded && max <= MAX_COUNTED_IN_DFA {
                    let key = format!("string {pattern:?} {format:?} {min} {max}");
                    self.dfa(key, at, |_| {
                        let upper = (max < COUNT_LIMIT).then_some(max);
                        shape()?.intersect(&ByteDfa::char_count(min, upper)?)
                    })
                    .ok()
                } else {
                    None
                };
                let (dfa, min, max) = match product {
                    Some(dfa) => (dfa, 0, COUNT_LIMIT),
                    None => {
                        let key = format!("string {pattern:?} {format:?}");
                        let dfa = self.dfa(key, at, |_| shape())?;
                        let shortest = self.dfas[dfa as usize].chars_left(0);
                        if shortest > max {
                            return Err(schema_error(format!(
                                "{at}: no value of its pattern or format has at most maxLength {max} characters"
                            )));
                        }
                        if bounded && shortest < min {
                            return Err(schema_error(format!(
                                "{at}: minLength {min} together with a pattern or format whose values may be \
                                 shorter ({shortest}) is not supported unless maxLength is at most \
                                 {MAX_COUNTED_IN_DFA}"
                            )));
                        }
                        (dfa, 0, max)
                    }
                };
                self.add(Node::Matched {
                    dfa,
                    quoted: true,
                    min,
                    max,
                })
            }
            "array" => {
                let (min, mut max) = Self::bounds(map, ("minItems", "maxItems"), at)?;
                let id = self.reserve()?;
                // A tuple's positions: `prefixItems` (2020-12) with `items` for the rest, or `items` as a list
                // (drafts 4-2019) with `additionalItems` for the rest.
                let (prefix, rest_key) = match (map.get("prefixItems"), map.get("items")) {
                    (Some(Value::Array(p)), _) => (Some(("prefixItems", p)), "items"),
                    (Some(p), _) => {
                        return Err(schema_error(format!("{at}.prefixItems must be a list, got {p}")))
                    }
                    (None, Some(Value::Array(p))) => (Some(("items", p)), "additionalItems"),
                    (None, _) => (None, "items"),
                };
                let mut positions = Vec::new();
                if let Some((key, list)) = prefix {
                    for (i, s) in list.iter().enumerate() {
                        positions.push(self.compile(s, &format!("{at}.{key}[{i}]"))?);
                    }
                }
                let items = match map.get(rest_key) {
                    None | Some(Value::Bool(true)) => self.any()?,
                    // No items past the tuple's (a placeholder never read).
                    Some(Value::Bool(false)) => {
                        max = max.min(positions.len() as u32);
                        if min > max {
                            return Err(schema_error(format!(
                                "{at}: minItems {min} is more than the tuple's {} positions",
                                positions.len()
                            )));
                        }
                        self.any()?
                    }
                    Some(s) => self.compile(s, &format!("{at}.{rest_key}"))?,
                };
                let unique = match map.get("uniqueItems") {
                    None | Some(Value::Bool(false)) => false,
                    Some(Value::Bool(true)) => true,
                    Some(v) => {
                        return Err(schema_error(format!("{at}.uniqueItems must be true or false, got {v}")))
                    }
                };
                if unique {
                    // Distinct items are kept track of only among a few fixed texts (`enum` / `const` items: a
                    // set of choices), a bit each in the array's frame.
                    let texts = self.literal_count(items).filter(|&n| n <= 16 && positions.is_empty());
                    let Some(texts) = texts else {
                        return Err(schema_error(format!(
                            "{at}.uniqueItems is supported only for items given by enum or const (at most 16 values), \
                             not for a tuple or other items"
                        )));
                    };
                    max = max.min(texts);
                    if min > max {
                        return Err(schema_error(format!(
                            "{at}: minItems {min} is more than its {texts} distinct values"
                        )));
                    }
                }
                self.nodes[id as usize] = Node::Array {
                    prefix: positions,
                    items,
                    min,
                    max,
                    unique,
                };
                Ok(id)
            }
            "object" => self.object(map, at),
            other => Err(schema_error(format!(
                "{at}.type {other:?} is not a JSON Schema type (object, array, string, number, integer, boolean, null)"
            ))),
        }
    }

    fn object(&mut self, map: &serde_json::Map<String, Value>, at: &str) -> Result<NodeId> {
        let id = self.reserve()?;
        let empty = serde_json::Map::new();
        let properties = match map.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(p) => {
                return Err(schema_error(format!(
                    "{at}.properties must be an object, got {p}"
                )))
            }
        };
        if properties.len() >= u16::MAX as usize {
            return Err(schema_error(format!("{at} lists too many properties")));
        }
        let mut required = vec![false; properties.len()];
        if let Some(list) = map.get("required") {
            let list = list
                .as_array()
                .ok_or_else(|| schema_error(format!("{at}.required must be a list of names")))?;
            for name in list {
                let name = name.as_str().ok_or_else(|| {
                    schema_error(format!("{at}.required lists {name}, not a property name"))
                })?;
                let i = properties.keys().position(|k| k == name).ok_or_else(|| {
                    schema_error(format!(
                        "{at}.required names {name:?}, which is not in its properties (only listed properties are written)"
                    ))
                })?;
                required[i] = true;
            }
        }
        let mut props = Vec::with_capacity(properties.len());
        let mut keys = Vec::with_capacity(properties.len());
        for (name, schema) in properties {
            keys.push(serde_json::to_vec(name).expect("a string serializes"));
            props.push(self.compile(schema, &format!("{at}.properties.{name}"))?);
        }
        let mut next_required = vec![props.len() as u16; props.len() + 1];
        let mut required_after = vec![0u16; props.len() + 1];
        for i in (0..props.len()).rev() {
            next_required[i] = if required[i] {
                i as u16
            } else {
                next_required[i + 1]
            };
            required_after[i] = required_after[i + 1] + required[i] as u16;
        }
        // `patternProperties`: one pattern, on an object that lists no properties (keys matching it are then the
        // only ones written, with its values; a listed key would have to meet both).
        let patterned = match map.get("patternProperties") {
            None => None,
            Some(Value::Object(p)) if p.len() == 1 && properties.is_empty() => p.iter().next(),
            Some(Value::Object(p)) if p.len() == 1 => {
                return Err(schema_error(format!(
                    "{at} has both properties and patternProperties, which is not supported"
                )))
            }
            Some(Value::Object(p)) if p.is_empty() => None,
            Some(_) => {
                return Err(schema_error(format!(
                    "{at}.patternProperties must be an object of one pattern (several are not supported)"
                )))
            }
        };
        let key = self.property_names(map, patterned.map(|(p, _)| p.as_str()), at)?;
        // Listed properties are the only keys written (an object without the others still matches); with none
        // listed, patternProperties or additionalProperties decides.
        let any_keys = if let Some((pattern, values)) = patterned {
            Some(self.compile(values, &format!("{at}.patternProperties.{pattern}"))?)
        } else if props.is_empty() {
            match map.get("additionalProperties") {
                None | Some(Value::Bool(true)) => Some(self.any()?),
                Some(Value::Bool(false)) => None,
                Some(s) => Some(self.compile(s, &format!("{at}.additionalProperties"))?),
            }
        } else {
            None
        };
        let min = Self::count(map, "minProperties", at)?.unwrap_or(0);
        let max = Self::count(map, "maxProperties", at)?.unwrap_or(COUNT_LIMIT);
        let required_count = required.iter().filter(|&&r| r).count() as u32;
        if min > max {
            return Err(schema_error(format!(
                "{at}: minProperties {min} is more than maxProperties {max}"
            )));
        }
        if required_count > max {
            return Err(schema_error(format!(
                "{at} requires {required_count} properties but maxProperties is {max}"
            )));
        }
        match any_keys {
            None if min > props.len() as u32 => {
                return Err(schema_error(format!(
                    "{at}: minProperties {min} is more than the {} properties that may be written",
                    props.len()
                )))
            }
            None if props.len() > u8::MAX as usize && (min > 0 || max < COUNT_LIMIT) => {
                return Err(schema_error(format!(
                    "{at}: minProperties / maxProperties with more than 255 listed properties is not supported"
                )))
            }
            // Keys chosen freely may repeat, and a repeated key is one property to a parser: a count of keys
            // written says at most how many there are, not at least.
            Some(_) if min > 1 => {
                return Err(schema_error(format!(
                    "{at}: minProperties {min} on an object of free keys is not supported (keys may repeat; list                      the properties instead)"
                )))
            }
            _ => {}
        }
        self.nodes[id as usize] = Node::Object(ObjectNode {
            props,
            next_required,
            keys: Trie::new(&keys)?,
            any_keys,
            key,
            closed: map.get("additionalProperties") == Some(&Value::Bool(false)),
            min,
            max,
            required_after,
        });
        Ok(id)
    }

    /// The string node keys are read with: `propertyNames`, with `pattern` (a `patternProperties` pattern) added
    /// to it. None where keys are any strings.
    fn property_names(
        &mut self,
        map: &serde_json::Map<String, Value>,
        pattern: Option<&str>,
        at: &str,
    ) -> Result<Option<NodeId>> {
        let mut names = match map.get("propertyNames") {
            None if pattern.is_none() => return Ok(None),
            None => serde_json::Map::new(),
            Some(Value::Object(n)) => n.clone(),
            Some(Value::Bool(true)) if pattern.is_none() => return Ok(None),
            Some(Value::Bool(true)) => serde_json::Map::new(),
            Some(other) => {
                return Err(schema_error(format!(
                    "{at}.propertyNames must be a schema object, got {other}"
                )))
            }
        };
        if let Some(p) = pattern {
            if names.contains_key("pattern") {
                return Err(schema_error(format!(
                    "{at}: a propertyNames pattern beside patternProperties is not supported"
                )));
            }
            names.insert("pattern".into(), Value::String(p.into()));
        }
        if !names.contains_key("enum")
            && !names.contains_key("const")
            && !names.contains_key("$ref")
        {
            names
                .entry("type")
                .or_insert(Value::String("string".into()));
        }
        let compiled = self.compile(&Value::Object(names), &format!("{at}.propertyNames"))?;
        Ok(Some(compiled))
    }
}

/// 256 bits: the bytes a value may start with.
type ByteSet = [u64; 4];

fn has(set: &ByteSet, b: u8) -> bool {
    set[b as usize / 64] >> (b % 64) & 1 == 1
}

impl JsonGrammar {
    /// Any JSON object (`response_format` `json_object`).
    pub fn any_object() -> JsonGrammar {
        let document = Value::Null;
        let mut c = Compiler {
            document: &document,
            nodes: Vec::new(),
            dfas: Vec::new(),
            dfa_ids: HashMap::new(),
            refs: HashMap::new(),
            any: None,
            depth: 0,
        };
        let root = c
            .object(&serde_json::Map::new(), "schema")
            .expect("the any-object grammar is small");
        debug_assert_eq!(root, 0);
        JsonGrammar::finish(c.nodes, c.dfas)
            .expect("the any-object grammar's unions begin differently")
    }

    /// Compiles a JSON Schema whose root is an object (or a union of objects). Enforced: `type` (one or a list),
    /// `properties` (written in the order listed; optional ones may be left out, others are never written),
    /// `required`, `additionalProperties` (for objects that list no properties; `false` also tells `oneOf`
    /// alternatives apart), `items`, `minItems`, `maxItems`, `minLength`, `maxLength`, `enum`, `const`, `anyOf` /
    /// `oneOf` (alternatives that begin alike, such as two objects, are followed side by side, at most
    /// `MAX_PATHS` at once; a `oneOf`'s must exclude one another: a required property with a different `const`
    /// in each, or one the other's `additionalProperties: false` forbids), `allOf` of one schema, `$ref` into
    /// the schema itself (recursion included), tuples (`prefixItems`, `items` as a list, `additionalItems`),
    /// `propertyNames` (keys read as values of that string schema), `patternProperties` of one pattern on an
    /// object that lists no properties, `minProperties` / `maxProperties` (at most 1 minimum where keys are free,
    /// since free keys may repeat), and
    /// values shaped by automata (`json_mode/byte_dfa.rs`): `pattern`, `format` (`value_regex::FORMATS`),
    /// `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` and `multipleOf`. Annotations (`title`,
    /// `description`, `default`, `discriminator`, ...) are ignored; any other keyword (`dependentRequired`,
    /// `if` / `then`, ...) is refused by name rather than left unenforced.
    pub fn from_schema(schema: &Value) -> Result<JsonGrammar> {
        let mut c = Compiler {
            document: schema,
            nodes: Vec::new(),
            dfas: Vec::new(),
            dfa_ids: HashMap::new(),
            refs: HashMap::new(),
            any: None,
            depth: 0,
        };
        let root = c.compile(schema, "schema")?;
        let mut nodes = c.nodes;
        // The root's own node first: follow aliases down to the object or the union of objects.
        let mut at = root;
        for _ in 0..=nodes.len() {
            match &nodes[at as usize] {
                Node::Union { alts, .. } if alts.len() == 1 => at = alts[0],
                _ => break,
            }
        }
        if !only_objects(&nodes, at, &mut Vec::new()) {
            return Err(schema_error(
                "the schema's root must be an object (\"type\": \"object\"), or a union of objects",
            ));
        }
        nodes.swap(0, at as usize);
        // Renumber the two swapped ids everywhere.
        let swap = |id: &mut NodeId| {
            if *id == 0 {
                *id = at
            } else if *id == at {
                *id = 0
            }
        };
        for node in &mut nodes {
            match node {
                Node::Object(o) => {
                    o.props.iter_mut().for_each(swap);
                    o.any_keys.iter_mut().for_each(swap);
                    o.key.iter_mut().for_each(swap);
                }
                Node::Array { prefix, items, .. } => {
                    prefix.iter_mut().for_each(swap);
                    swap(items)
                }
                Node::Union { alts, .. } => alts.iter_mut().for_each(swap),
                _ => {}
            }
        }
        JsonGrammar::finish(nodes, c.dfas)
    }

    /// Output that matches `regex` whole (vLLM's `guided_regex`, SGLang's `regex`): Rust regex syntax with Unicode
    /// classes (Python's `re` for the common subset; no lookaround or backreferences), no JSON around it. The
    /// output may stop wherever the regex matches what was written, and must stop where nothing can follow.
    pub fn from_regex(regex: &str) -> Result<JsonGrammar> {
        let dfa = ByteDfa::from_regex(regex, |_| true).map_err(|e| {
            Error::InvalidArgument(format!("regex {regex:?} cannot be enforced: {e}"))
        })?;
        if dfa.states() > MAX_DFA_STATES {
            return Err(Error::InvalidArgument(format!(
                "regex {regex:?} needs more than {MAX_DFA_STATES} automaton states ({})",
                dfa.states()
            )));
        }
        let root = Node::Matched {
            dfa: 0,
            quoted: false,
            min: 0,
            max: COUNT_LIMIT,
        };
        let mut grammar = JsonGrammar::finish(vec![root], vec![dfa])?;
        grammar.bare = true;
        Ok(grammar)
    }

    /// Output that is exactly one of `choices` (vLLM's `guided_choice`): at least one, none empty, at most
    /// `MAX_CHOICES`.
    pub fn from_choices(choices: &[String]) -> Result<JsonGrammar> {
        if choices.is_empty() {
            return Err(Error::InvalidArgument(
                "the list of choices is empty: give at least one".into(),
            ));
        }
        if choices.len() > MAX_CHOICES {
            return Err(Error::InvalidArgument(format!(
                "{} choices given; at most {MAX_CHOICES} are taken",
                choices.len()
            )));
        }
        if let Some(i) = choices.iter().position(String::is_empty) {
            return Err(Error::InvalidArgument(format!("choice {i} is empty")));
        }
        let alternatives: Vec<String> = choices.iter().map(|c| regex_literal(c)).collect();
        JsonGrammar::from_regex(&alternatives.join("|")).map_err(|e| {
            Error::InvalidArgument(e.to_string().replacen("regex", "the choices as a regex", 1))
        })
    }

    /// Notes each node's first bytes and where a union's alternatives begin alike (the paths a state forks
    /// into), and checks that no union holds itself, that no byte forks into more than `MAX_PATHS` paths, and
    /// that a `oneOf`'s alternatives that begin alike exclude one another.
    fn finish(nodes: Vec<Node>, dfas: Vec<ByteDfa>) -> Result<JsonGrammar> {
        let mut grammar = JsonGrammar {
            nodes,
            first: Vec::new(),
            dfas,
            forks: HashMap::new(),
            forking: Vec::new(),
            bare: false,
        };
        grammar.first = (0..grammar.nodes.len())
            .map(|id| grammar.first_bytes(id as NodeId, &mut Vec::new()))
            .collect::<Result<_>>()?;
        grammar.forking = vec![false; grammar.nodes.len()];
        let mut leaves = HashMap::new();
        for id in 0..grammar.nodes.len() as NodeId {
            let Node::Union { alts, one_of, at } = &grammar.nodes[id as usize] else {
                continue;
            };
            for b in 0..=255u8 {
                if !has(&grammar.first[id as usize], b) {
                    continue;
                }
                let ends = grammar.leaves(id, b, &mut leaves)?;
                if ends.len() > MAX_PATHS {
                    return Err(schema_error(format!(
                        "{at}: {} alternatives can begin with {:?}; at most {MAX_PATHS} are followed at once",
                        ends.len(),
                        b as char
                    )));
                }
                if ends.len() > 1 {
                    grammar.forks.insert((id, b), ends.into());
                    grammar.forking[id as usize] = true;
                }
                if !*one_of {
                    continue;
                }
                let alike: Vec<(usize, NodeId)> = alts
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|&(_, alt)| has(&grammar.first[alt as usize], b))
                    .collect();
                for (n, &(i, x)) in alike.iter().enumerate() {
                    for &(j, y) in &alike[n + 1..] {
                        if !grammar.exclusive(x, y) {
                            return Err(schema_error(format!(
                                "{at}: alternatives {i} and {j} can both match one value (both begin with {:?}), \
                                 but oneOf needs exactly one to: use anyOf, or give each a required property \
                                 with a different const (a discriminator)",
                                b as char
                            )));
                        }
                    }
                }
            }
        }
        // (Reads keys with the finished grammar, forks included.)
        grammar.check_property_names()?;
        Ok(grammar)
    }

    /// Keys read with a node (`propertyNames`) must be strings, and listed keys must be among them.
    fn check_property_names(&self) -> Result<()> {
        // Only '"' (0x22): bit 34 of the first word.
        let quote: ByteSet = [1 << b'"', 0, 0, 0];
        for node in &self.nodes {
            let Node::Object(o) = node else { continue };
            let Some(key) = o.key else { continue };
            if self.first[key as usize] != quote {
                return Err(schema_error(
                    "propertyNames must describe strings (keys are strings)",
                ));
            }
            for text in &o.keys.texts {
                let mut path = Path::default();
                path.frames[0].node = key;
                let taken = self
                    .after(JsonState::from_paths(&[path]), text)
                    .is_some_and(|s| s.is_done());
                if !taken {
                    return Err(schema_error(format!(
                        "property {} does not match the object's propertyNames",
                        String::from_utf8_lossy(text)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The nodes other than unions that a value of `id` beginning with `b` may be (through nested unions),
    /// each once, in the order the alternatives list them. Kept per (union, byte) in `memo`, so that unions
    /// sharing alternatives through `$ref` cost their size, not the paths through them.
    fn leaves(
        &self,
        id: NodeId,
        b: u8,
        memo: &mut HashMap<(NodeId, u8), Vec<NodeId>>,
    ) -> Result<Vec<NodeId>> {
        let Node::Union { alts, .. } = &self.nodes[id as usize] else {
            return Ok(vec![id]);
        };
        if let Some(known) = memo.get(&(id, b)) {
            return Ok(known.clone());
        }
        let mut ends = Vec::new();
        for &alt in alts {
            if !has(&self.first[alt as usize], b) {
                continue;
            }
            for end in self.leaves(alt, b, memo)? {
                if !ends.contains(&end) {
                    ends.push(end);
                }
            }
            if ends.len() > MAX_PATHS {
                break;
            }
        }
        memo.insert((id, b), ends.clone());
        Ok(ends)
    }

    /// Whether no value matches both `a` and `b` (objects, as far as this can tell: one requires a property
    /// the other forbids, or both require one whose fixed values differ).
    fn exclusive(&self, a: NodeId, b: NodeId) -> bool {
        let (Some(x), Some(y)) = (
            self.object_through_aliases(a),
            self.object_through_aliases(b),
        ) else {
            return false;
        };
        let required = |o: &ObjectNode| -> Vec<usize> {
            (0..o.props.len())
                .filter(|&i| o.next_required[i] as usize == i)
                .collect()
        };
        let position = |o: &ObjectNode, key: &[u8]| o.keys.texts.iter().position(|k| k == key);
        for (p, q) in [(x, y), (y, x)] {
            for i in required(p) {
                let key = &p.keys.texts[i];
                match position(q, key) {
                    None if q.closed && q.any_keys.is_none() => return true,
                    None => {}
                    Some(j) => {
                        let required_in_q = q.next_required[j] as usize == j;
                        if required_in_q && self.values_differ(p.props[i], q.props[j]) {
                            return true;
                        }
                    }
                }
            }
        }
        false
    }

    fn object_through_aliases(&self, mut id: NodeId) -> Option<&ObjectNode> {
        for _ in 0..=self.nodes.len() {
            match &self.nodes[id as usize] {
                Node::Union { alts, .. } if alts.len() == 1 => id = alts[0],
                Node::Object(o) => return Some(o),
                _ => return None,
            }
        }
        None
    }

    /// Whether two nodes are fixed texts with no JSON value in common.
    fn values_differ(&self, a: NodeId, b: NodeId) -> bool {
        let texts = |mut id: NodeId| -> Option<Vec<Value>> {
            for _ in 0..=self.nodes.len() {
                match &self.nodes[id as usize] {
                    Node::Union { alts, .. } if alts.len() == 1 => id = alts[0],
                    Node::Literals(trie) => {
                        return trie
                            .texts
                            .iter()
                            .map(|t| serde_json::from_slice(t).ok())
                            .collect()
                    }
                    _ => return None,
                }
            }
            None
        };
        let (Some(x), Some(y)) = (texts(a), texts(b)) else {
            return false;
        };
        x.iter().all(|u| y.iter().all(|v| !same_json_value(u, v)))
    }

    fn first_bytes(&self, id: NodeId, visiting: &mut Vec<NodeId>) -> Result<ByteSet> {
        let mut set: ByteSet = [0; 4];
        let mut add = |b: u8| set[b as usize / 64] |= 1 << (b % 64);
        match &self.nodes[id as usize] {
            Node::Object(_) => add(b'{'),
            Node::Array { .. } => add(b'['),
            Node::String { .. } => add(b'"'),
            Node::Number { .. } => b"-0123456789".iter().for_each(|&b| add(b)),
            Node::Matched { quoted: true, .. } => add(b'"'),
            Node::Matched {
                dfa, quoted: false, ..
            } => self.dfas[*dfa as usize].first_bytes().for_each(add),
            Node::Literals(trie) => trie.nodes[0].children.iter().for_each(|&(b, _)| add(b)),
            Node::Union { alts, .. } => {
                if visiting.contains(&id) {
                    return Err(schema_error("a $ref or union that only refers to itself"));
                }
                visiting.push(id);
                for &alt in alts {
                    let first = self.first_bytes(alt, visiting)?;
                    for w in 0..4 {
                        set[w] |= first[w];
                    }
                }
                visiting.pop();
            }
            Node::Pending => unreachable!("a finished grammar has no pending nodes"),
        }
        Ok(set)
    }
}

/// Whether `id` is an object, or a union whose alternatives all are (through nested unions).
fn only_objects(nodes: &[Node], id: NodeId, visiting: &mut Vec<NodeId>) -> bool {
    match &nodes[id as usize] {
        Node::Object(_) => true,
        Node::Union { alts, .. } => {
            if visiting.contains(&id) {
                return false;
            }
            visiting.push(id);
            let all = alts.iter().all(|&alt| only_objects(nodes, alt, visiting));
            visiting.pop();
            all
        }
        _ => false,
    }
}

/// JSON equality as a schema's `const` means it: numbers by value (1 and 1.0 are one number).
fn same_json_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(u, v)| same_json_value(u, v))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, u)| y.get(k).is_some_and(|v| same_json_value(u, v)))
        }
        _ => a == b,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
enum Phase {
    /// Before the value (the node's first byte decides; a union's picks its alternative).
    #[default]
    Start,
    /// After `{`: a key or `}`.
    ObjectOpen,
    /// After `,` in an object: a key.
    KeyNext,
    /// Inside a key (`aux`: the key trie's node; for any keys, `sub` and `aux` are the escape and UTF-8 states).
    Key,
    /// After a key: `:`.
    Colon,
    /// After `:`: the value.
    PropertyValue,
    /// After a property's value: `,` or `}`.
    ObjectAfter,
    /// After `[`: an item or `]`.
    ArrayOpen,
    /// After `,` in an array: an item.
    ItemNext,
    /// After an item: `,` or `]`.
    ArrayAfter,
    /// Inside a string (`sub`: the escape state, `aux`: characters so far, `count`: the UTF-8 state).
    String,
    /// Inside a number (`sub`: where, `NUM_*`).
    Number,
    /// Inside a fixed text (`aux`: the trie's node).
    Literal,
    /// Inside a value an automaton shapes (`count`: its state).
    Matched,
}

impl Phase {
    fn takes_whitespace(self) -> bool {
        matches!(
            self,
            Phase::Start
                | Phase::ObjectOpen
                | Phase::KeyNext
                | Phase::Colon
                | Phase::PropertyValue
                | Phase::ObjectAfter
                | Phase::ArrayOpen
                | Phase::ItemNext
                | Phase::ArrayAfter
        )
    }
}

// Escape states of a string (`Frame::sub`): none, after a backslash, or n = 4..1 hex digits of `\u` still to come
// (ESC_HEX_BASE + n: 5..2).
const ESC_NONE: u8 = 0;
const ESC_BACKSLASH: u8 = 1;
const ESC_HEX_BASE: u8 = 1;

// Where a number is (`Frame::sub`): after `-`, a lone `0`, integer digits, `.`, fraction digits, `e`, the
// exponent's sign, its digits.
const NUM_MINUS: u8 = 0;
const NUM_ZERO: u8 = 1;
const NUM_INT: u8 = 2;
const NUM_DOT: u8 = 3;
const NUM_FRAC: u8 = 4;
const NUM_E: u8 = 5;
const NUM_E_SIGN: u8 = 6;
const NUM_EXP: u8 = 7;

fn number_next(part: u8, b: u8, integer: bool) -> Option<u8> {
    Some(match (part, b) {
        (NUM_MINUS, b'0') => NUM_ZERO,
        (NUM_MINUS, b'1'..=b'9') => NUM_INT,
        (NUM_INT, b'0'..=b'9') => NUM_INT,
        (NUM_ZERO | NUM_INT, b'.') if !integer => NUM_DOT,
        (NUM_DOT | NUM_FRAC, b'0'..=b'9') => NUM_FRAC,
        (NUM_ZERO | NUM_INT | NUM_FRAC, b'e' | b'E') if !integer => NUM_E,
        (NUM_E, b'+' | b'-') => NUM_E_SIGN,
        (NUM_E | NUM_E_SIGN | NUM_EXP, b'0'..=b'9') => NUM_EXP,
        _ => return None,
    })
}

fn number_complete(part: u8) -> bool {
    matches!(part, NUM_ZERO | NUM_INT | NUM_FRAC | NUM_EXP)
}

/// One open container or the value being written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
struct Frame {
    node: NodeId,
    phase: Phase,
    sub: u8,
    aux: u16,
    /// An object's next property not yet written (a key's property once it is read); an array's items so far; a
    /// string's UTF-8 state.
    count: u16,
}

/// One way of reading the output so far: the frames open, innermost last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Path {
    frames: [Frame; MAX_DEPTH],
    len: u8,
    /// Whitespace bytes just read in a row.
    spaces: u8,
}

impl Default for Path {
    /// Before the output: the root (node 0) not begun.
    fn default() -> Self {
        Path {
            frames: [Frame::default(); MAX_DEPTH],
            len: 1,
            spaces: 0,
        }
    }
}

impl Path {
    fn is_done(&self) -> bool {
        self.len == 0
    }

    fn top(&mut self) -> &mut Frame {
        &mut self.frames[self.len as usize - 1]
    }

    fn push(&mut self, node: NodeId) -> bool {
        if self.len as usize >= MAX_DEPTH {
            return false;
        }
        self.frames[self.len as usize] = Frame {
            node,
            ..Frame::default()
        };
        self.len += 1;
        true
    }

    /// The innermost value is complete.
    fn pop(&mut self) -> bool {
        self.len -= 1;
        self.frames[self.len as usize] = Frame::default();
        true
    }
}

/// How far a prefix of the output has come through the grammar's value: the paths that read it (one, except
/// where a union's alternatives began alike and the bytes since have not told them apart), in a fixed order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JsonState {
    /// `paths[..count]`; the rest stay default, so that equal sets of paths in one order are equal states.
    paths: [Path; MAX_PATHS],
    count: u8,
}

impl Default for JsonState {
    /// Before the output: the root not begun.
    fn default() -> Self {
        JsonState {
            paths: [Path::default(); MAX_PATHS],
            count: 1,
        }
    }
}

impl JsonState {
    /// The JSON value is complete: a stop token may follow (and nothing else, since every path read one value:
    /// its closing brace closes them all). A bare text (a regex, choices) is never "done" this way: it may end
    /// where [`JsonGrammar::may_end`] says.
    pub fn is_done(&self) -> bool {
        self.paths().iter().any(Path::is_done)
    }

    fn paths(&self) -> &[Path] {
        &self.paths[..self.count as usize]
    }

    /// The paths (at least one, deduplicated, at most `MAX_PATHS`: the first ones) as a state.
    fn from_paths(paths: &[Path]) -> JsonState {
        let mut state = JsonState {
            paths: [Path::default(); MAX_PATHS],
            count: paths.len().min(MAX_PATHS) as u8,
        };
        state.paths[..state.count as usize].copy_from_slice(&paths[..state.count as usize]);
        state
    }
}

impl JsonGrammar {
    /// Whether the output may stop in `state`: a JSON value is complete, or a bare text's automaton accepts what
    /// was written (it may also go on where the automaton allows).
    pub fn may_end(&self, state: JsonState) -> bool {
        state.paths().iter().any(|p| self.path_may_end(p))
    }

    fn path_may_end(&self, p: &Path) -> bool {
        if p.is_done() {
            return true;
        }
        if !self.bare || p.len != 1 {
            return false;
        }
        let f = p.frames[0];
        let Node::Matched { dfa, .. } = self.nodes[f.node as usize] else {
            return false;
        };
        let dfa = &self.dfas[dfa as usize];
        match f.phase {
            Phase::Start => dfa.accepts(0),
            Phase::Matched => dfa.accepts(f.count),
            _ => false,
        }
    }

    /// The state after `bytes`, or None where they leave the language.
    pub fn after(&self, state: JsonState, bytes: &[u8]) -> Option<JsonState> {
        // One path that does not fork (nearly every token): stepped in place, nothing allocated.
        if let [one] = state.paths() {
            let mut p = *one;
            let mut fork = false;
            if bytes.iter().all(|&b| self.step(&mut p, b, &mut fork)) {
                return Some(JsonState::from_paths(&[p]));
            }
            if !fork {
                return None;
            }
        }
        let mut all = Vec::with_capacity(state.count as usize);
        let (mut paths, mut scratch) = (Vec::new(), Vec::new());
        for &start in state.paths() {
            paths.clear();
            paths.push(start);
            if self.walk(&mut paths, &mut scratch, bytes) {
                for p in &paths {
                    if !all.contains(p) {
                        all.push(*p);
                    }
                }
            }
        }
        (!all.is_empty()).then(|| JsonState::from_paths(&all))
    }

    /// Reads `bytes` on `paths` (deduplicated, at most `MAX_PATHS`): afterwards, every path they became (the
    /// first `MAX_PATHS` where more). False where none is left. Each path of a state walks on its own, so that a
    /// state's mask is the union of its paths' (each computed once, whatever state holds it) and allows exactly
    /// the tokens `JsonGrammar::after` takes.
    fn walk(&self, paths: &mut Vec<Path>, scratch: &mut Vec<Path>, bytes: &[u8]) -> bool {
        for &b in bytes {
            if let [only] = paths.as_mut_slice() {
                let mut fork = false;
                if self.step(only, b, &mut fork) {
                    continue;
                }
                if !fork {
                    paths.clear();
                    return false;
                }
                // Left where the byte begins a union's alternatives alike: read below, once per alternative.
            }
            scratch.clear();
            for &p in paths.iter() {
                self.step_forking(p, b, scratch);
            }
            paths.clear();
            for p in scratch.iter() {
                if paths.len() < MAX_PATHS && !paths.contains(p) {
                    paths.push(*p);
                }
            }
            if paths.is_empty() {
                return false;
            }
        }
        true
    }

    /// Whether `walk` from `paths` takes `bytes` (`work` and `scratch` are its buffers). One path, the usual
    /// case, is stepped in place until it forks.
    fn takes(
        &self,
        paths: &[Path],
        bytes: &[u8],
        work: &mut Vec<Path>,
        scratch: &mut Vec<Path>,
    ) -> bool {
        if let [one] = paths {
            let mut p = *one;
            for (i, &b) in bytes.iter().enumerate() {
                let mut fork = false;
                if self.step(&mut p, b, &mut fork) {
                    continue;
                }
                if !fork {
                    return false;
                }
                work.clear();
                work.push(p);
                return self.walk(work, scratch, &bytes[i..]);
            }
            return true;
        }
        work.clear();
        work.extend_from_slice(paths);
        self.walk(work, scratch, bytes)
    }

    /// Reads `b` on `path` into `out`: nothing where it leaves the language, one path for each alternative of
    /// a union that `b` begins alike. `path` may be one that `step` left at such a union with `b` unread.
    fn step_forking(&self, mut path: Path, b: u8, out: &mut Vec<Path>) {
        let mut fork = false;
        if self.step(&mut path, b, &mut fork) {
            out.push(path);
            return;
        }
        if !fork {
            return;
        }
        let union = path.top().node;
        for &alt in self.forks[&(union, b)].iter() {
            let mut p = path;
            p.top().node = alt;
            let mut again = false;
            if self.step(&mut p, b, &mut again) {
                out.push(p);
            }
            debug_assert!(!again, "fork alternatives are not unions");
        }
    }

    /// Where `state` is inside a string (a value, or a key of an object that takes any keys), that string's state.
    fn string_scan(&self, state: &Path) -> Option<StringScan> {
        let f = state.frames[(state.len as usize).checked_sub(1)?];
        match (f.phase, &self.nodes[f.node as usize]) {
            (Phase::String, &Node::String { max, .. }) => Some(StringScan {
                escape: f.sub,
                utf8: f.count,
                chars: f.aux as u32,
                max,
            }),
            (Phase::Key, Node::Object(o)) if o.any_keys.is_some() => Some(StringScan {
                escape: f.sub,
                utf8: f.aux,
                chars: 0,
                max: COUNT_LIMIT,
            }),
            _ => None,
        }
    }

    /// Where the value being written is an item of a `uniqueItems` array, the items written before it (a bit
    /// per fixed text, kept in the array's frame).
    fn unique_siblings(&self, s: &Path) -> Option<u16> {
        let len = s.len as usize;
        let parent = s.frames[len.checked_sub(2)?];
        match &self.nodes[parent.node as usize] {
            Node::Array { unique: true, .. } => Some(parent.aux),
            _ => None,
        }
    }

    fn object(&self, id: NodeId) -> &ObjectNode {
        match &self.nodes[id as usize] {
            Node::Object(o) => o,
            _ => unreachable!("object phases belong to object nodes"),
        }
    }

    /// Reads `b` on one path: false where it leaves the language, or (with `fork` set, the path left at the
    /// union) where `b` begins several of a union's alternatives alike.
    fn step(&self, s: &mut Path, b: u8, fork: &mut bool) -> bool {
        let whitespace = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        loop {
            if s.is_done() {
                return false;
            }
            let f = *s.top();
            let node = &self.nodes[f.node as usize];
            // A number or a fixed text ends at the first byte that cannot continue it, which the container then
            // reads.
            match f.phase {
                Phase::Number => {
                    let integer = matches!(node, Node::Number { integer: true });
                    match number_next(f.sub, b, integer) {
                        Some(part) => {
                            s.top().sub = part;
                            return true;
                        }
                        None if number_complete(f.sub) => {
                            s.pop();
                            continue;
                        }
                        None => return false,
                    }
                }
                Phase::Matched => {
                    let Node::Matched {
                        dfa,
                        quoted,
                        min,
                        max,
                    } = *node
                    else {
                        unreachable!("matched phases belong to matched nodes")
                    };
                    let dfa = &self.dfas[dfa as usize];
                    if let Some(next) = dfa.next(f.count, b) {
                        if max < COUNT_LIMIT {
                            // Counted here: only while the value can still end within `max` characters.
                            let chars = f.aux as u32 + u32::from(!(0x80..=0xBF).contains(&b));
                            if chars.saturating_add(dfa.chars_left(next)) > max {
                                return false;
                            }
                            s.top().aux = count_kept(chars, min, max);
                        }
                        s.top().count = next;
                        return true;
                    }
                    // A string ends at its quote, a number at the first byte that does not continue it.
                    let whole = dfa.accepts(f.count);
                    if quoted {
                        return b == b'"' && whole && s.pop();
                    }
                    if !whole {
                        return false;
                    }
                    s.pop();
                    continue;
                }
                Phase::Literal => {
                    let Node::Literals(trie) = node else {
                        unreachable!("literal phases belong to literal nodes")
                    };
                    let used = self.unique_siblings(s);
                    if let Some(c) = trie.child(f.aux, b) {
                        if used.is_none_or(|u| trie.leads_to_unused(c, u)) {
                            s.top().aux = c;
                            return true;
                        }
                    }
                    if let Some(text) = trie.end(f.aux) {
                        if let Some(u) = used {
                            // An item of a uniqueItems array: not one written before, and noted as written.
                            if text < 16 && u >> text & 1 == 1 {
                                return false;
                            }
                            let parent = s.len as usize - 2;
                            s.frames[parent].aux |= 1 << text;
                        }
                        s.pop();
                        continue;
                    }
                    return false;
                }
                _ => {}
            }
            // A bare text's automaton reads its whitespace itself.
            if whitespace && f.phase.takes_whitespace() && !self.bare {
                if s.spaces >= MAX_WHITESPACE_RUN {
                    return false;
                }
                s.spaces += 1;
                return true;
            }
            s.spaces = 0;
            match f.phase {
                Phase::Start => {
                    let used = self.unique_siblings(s);
                    let top = s.top();
                    match (node, b) {
                        (Node::Union { .. }, _)
                            if self.forking[f.node as usize]
                                && self.forks.contains_key(&(f.node, b)) =>
                        {
                            *fork = true;
                            return false;
                        }
                        (Node::Union { alts, .. }, _) => {
                            match alts.iter().find(|&&alt| has(&self.first[alt as usize], b)) {
                                Some(&alt) => {
                                    top.node = alt;
                                    continue;
                                }
                                None => return false,
                            }
                        }
                        (Node::Object(_), b'{') => top.phase = Phase::ObjectOpen,
                        (Node::Array { .. }, b'[') => top.phase = Phase::ArrayOpen,
                        (Node::String { .. }, b'"') => top.phase = Phase::String,
                        (&Node::Matched { quoted: true, .. }, b'"') => {
                            top.phase = Phase::Matched;
                            top.count = 0;
                            top.aux = 0;
                        }
                        (
                            &Node::Matched {
                                dfa, quoted: false, ..
                            },
                            _,
                        ) => match self.dfas[dfa as usize].next(0, b) {
                            Some(next) => {
                                top.phase = Phase::Matched;
                                top.count = next;
                            }
                            None => return false,
                        },
                        (Node::Number { .. }, b'-' | b'0'..=b'9') => {
                            top.phase = Phase::Number;
                            top.sub = match b {
                                b'-' => NUM_MINUS,
                                b'0' => NUM_ZERO,
                                _ => NUM_INT,
                            };
                        }
                        (Node::Literals(trie), _) => match trie.child(0, b) {
                            Some(c) if used.is_none_or(|u| trie.leads_to_unused(c, u)) => {
                                top.phase = Phase::Literal;
                                top.aux = c;
                            }
                            _ => return false,
                        },
                        _ => return false,
                    }
                    return true;
                }
                Phase::ObjectOpen | Phase::KeyNext => {
                    let o = self.object(f.node);
                    let written = written_properties(o, &f);
                    return match (b, o.key) {
                        (b'"', _) if o.any_keys.is_some() && !o.takes_another_key(written) => false,
                        (b'"', Some(key)) if o.any_keys.is_some() => {
                            // The key is a value of its own node, read in a frame above this one; the object
                            // takes the colon once that frame closes.
                            s.top().phase = Phase::Colon;
                            if !s.push(key) {
                                return false;
                            }
                            continue;
                        }
                        (b'"', None) if o.any_keys.is_some() => {
                            let top = s.top();
                            top.phase = Phase::Key;
                            top.sub = ESC_NONE;
                            top.aux = 0;
                            true
                        }
                        (b'"', _) => match (o.keys.child(0, b), o.key_range(f.count, written)) {
                            (Some(c), Some(range)) if o.keys.leads_to(c, range) => {
                                let top = s.top();
                                top.phase = Phase::Key;
                                top.aux = c;
                                true
                            }
                            _ => false,
                        },
                        (b'}', _)
                            if f.phase == Phase::ObjectOpen && o.may_close(f.count, written) =>
                        {
                            s.pop()
                        }
                        _ => false,
                    };
                }
                Phase::Key => {
                    let o = self.object(f.node);
                    if o.any_keys.is_some() {
                        // Any key: a string whose UTF-8 state lies in `aux`.
                        return match string_step(f.sub, f.aux, b) {
                            StringStep::Continue { escape, utf8, .. } => {
                                let top = s.top();
                                top.sub = escape;
                                top.aux = utf8;
                                true
                            }
                            StringStep::Close => {
                                s.top().phase = Phase::Colon;
                                true
                            }
                            StringStep::Invalid => false,
                        };
                    }
                    let range = o.key_range(f.count, written_properties(o, &f));
                    return match (o.keys.child(f.aux, b), range) {
                        (Some(c), Some(range)) if o.keys.leads_to(c, range) => {
                            let top = s.top();
                            top.aux = c;
                            // Keys are JSON strings, so none is a prefix of another: the end is the key.
                            if let Some(property) = o.keys.end(c) {
                                top.count = property;
                                top.phase = Phase::Colon;
                            }
                            true
                        }
                        _ => false,
                    };
                }
                Phase::Colon => {
                    s.top().phase = Phase::PropertyValue;
                    return b == b':';
                }
                Phase::PropertyValue => {
                    let o = self.object(f.node);
                    let value = match o.any_keys {
                        Some(v) => v,
                        None => o.props[f.count as usize],
                    };
                    let written = written_properties(o, &f) + 1;
                    let top = s.top();
                    top.phase = Phase::ObjectAfter;
                    // Counted only as far as the bounds tell apart (so no new state per property).
                    let kept = count_kept(written, o.min, o.max);
                    if o.any_keys.is_none() {
                        top.count += 1;
                        top.sub = kept as u8;
                    } else {
                        top.count = kept;
                    }
                    if !s.push(value) {
                        return false;
                    }
                }
                Phase::ObjectAfter => {
                    let o = self.object(f.node);
                    let written = written_properties(o, &f);
                    let another = match o.any_keys {
                        Some(_) => o.takes_another_key(written),
                        None => o.key_range(f.count, written).is_some(),
                    };
                    return match b {
                        b',' if another => {
                            s.top().phase = Phase::KeyNext;
                            true
                        }
                        b'}' if o.may_close(f.count, written) => s.pop(),
                        _ => false,
                    };
                }
                Phase::ArrayOpen | Phase::ItemNext | Phase::ArrayAfter => {
                    let Node::Array {
                        prefix,
                        items,
                        min,
                        max,
                        ..
                    } = node
                    else {
                        unreachable!("array phases belong to array nodes")
                    };
                    let (min, max) = (*min, *max);
                    let count = f.count as u32;
                    let closes = b == b']' && count >= min;
                    match f.phase {
                        Phase::ArrayAfter => {
                            return match b {
                                b',' if count < max => {
                                    s.top().phase = Phase::ItemNext;
                                    true
                                }
                                b']' if closes => s.pop(),
                                _ => false,
                            }
                        }
                        Phase::ArrayOpen if b == b']' => return closes && s.pop(),
                        _ => {}
                    }
                    if count >= max {
                        return false;
                    }
                    let item = prefix.get(count as usize).copied().unwrap_or(*items);
                    let top = s.top();
                    top.phase = Phase::ArrayAfter;
                    // Counted exactly through the tuple's positions at least.
                    top.count = count_kept(count + 1, min.max(prefix.len() as u32), max);
                    if !s.push(item) {
                        return false;
                    }
                }
                Phase::String => {
                    let Node::String { min, max } = *node else {
                        unreachable!("string phases belong to string nodes")
                    };
                    return match string_step(f.sub, f.count, b) {
                        StringStep::Continue {
                            escape,
                            utf8,
                            character,
                        } => {
                            let chars = f.aux as u32 + character as u32;
                            if chars > max {
                                return false;
                            }
                            let top = s.top();
                            top.sub = escape;
                            top.aux = count_kept(chars, min, max);
                            top.count = utf8;
                            true
                        }
                        StringStep::Close => f.aux as u32 >= min && s.pop(),
                        StringStep::Invalid => false,
                    };
                }
                Phase::Number | Phase::Literal | Phase::Matched => unreachable!("read above"),
            }
        }
    }
}

/// Properties an object's frame has counted as written (`ObjectNode::min`).
fn written_properties(o: &ObjectNode, f: &Frame) -> u32 {
    match o.any_keys {
        Some(_) => f.count as u32,
        None => f.sub as u32,
    }
}

/// A count (a string's characters, an array's items) as a state keeps it: only as far as its bounds can tell
/// apart, so that an unbounded string or array does not make a new state (and a new mask) at every character or
/// item. With a maximum, up to it (a count past it was refused); with only a minimum, up to that.
fn count_kept(count: u32, min: u32, max: u32) -> u16 {
    let cap = if max < COUNT_LIMIT { max } else { min };
    count.min(cap) as u16
}

/// The state of a string being written, apart from the frames around it (`JsonGrammar::string_scan`).
#[derive(Clone, Copy)]
struct StringScan {
    escape: u8,
    utf8: u16,
    chars: u32,
    max: u32,
}

impl StringScan {
    /// Some(whether the string takes all of `bytes` and stays open); None where they close it (the grammar
    /// around it decides).
    fn run(mut self, bytes: &[u8]) -> Option<bool> {
        for &b in bytes {
            // Most bytes are plain ASCII outside any escape: one character each.
            if self.escape == ESC_NONE
                && self.utf8 == 0
                && (0x20..0x80).contains(&b)
                && b != b'"'
                && b != b'\\'
            {
                self.chars += 1;
                if self.chars > self.max {
                    return Some(false);
                }
                continue;
            }
            match string_step(self.escape, self.utf8, b) {
                StringStep::Continue {
                    escape,
                    utf8,
                    character,
                } => {
                    self.chars += character as u32;
                    if self.chars > self.max {
                        return Some(false);
                    }
                    self.escape = escape;
                    self.utf8 = utf8;
                }
                StringStep::Close => return None,
                StringStep::Invalid => return Some(false),
            }
        }
        Some(true)
    }
}

enum StringStep {
    /// Still inside: the escape and UTF-8 states after the byte, and whether the byte begins a character.
    Continue {
        escape: u8,
        utf8: u16,
        character: bool,
    },
    /// The closing quote.
    Close,
    Invalid,
}

// UTF-8 inside a string (`utf8`): continuation bytes still to come (low 2 bits) and the range the next one must
// fall in (`<< 2`), so that only well-formed UTF-8 passes (no overlong forms, surrogates or code points past
// U+10FFFF: RFC 3629), as JSON parsers require.
const UTF8_ANY: u16 = 0; // 0x80..=0xBF
const UTF8_A0: u16 = 1; // 0xA0..=0xBF (after 0xE0)
const UTF8_BELOW_A0: u16 = 2; // 0x80..=0x9F (after 0xED)
const UTF8_90: u16 = 3; // 0x90..=0xBF (after 0xF0)
const UTF8_BELOW_90: u16 = 4; // 0x80..=0x8F (after 0xF4)

/// The UTF-8 state after a lead byte `b` (>= 0x80), or None where it cannot begin a character.
fn utf8_lead(b: u8) -> Option<u16> {
    let (pending, range) = match b {
        0xC2..=0xDF => (1, UTF8_ANY),
        0xE0 => (2, UTF8_A0),
        0xE1..=0xEC | 0xEE..=0xEF => (2, UTF8_ANY),
        0xED => (2, UTF8_BELOW_A0),
        0xF0 => (3, UTF8_90),
        0xF1..=0xF3 => (3, UTF8_ANY),
        0xF4 => (3, UTF8_BELOW_90),
        _ => return None,
    };
    Some(pending | range << 2)
}

/// One byte of a JSON string's body, in escape state `escape` and UTF-8 state `utf8`.
fn string_step(escape: u8, utf8: u16, b: u8) -> StringStep {
    let pending = utf8 & 3;
    if pending > 0 {
        let fits = match utf8 >> 2 {
            UTF8_A0 => (0xA0..=0xBF).contains(&b),
            UTF8_BELOW_A0 => (0x80..=0x9F).contains(&b),
            UTF8_90 => (0x90..=0xBF).contains(&b),
            UTF8_BELOW_90 => (0x80..=0x8F).contains(&b),
            _ => (0x80..=0xBF).contains(&b),
        };
        return if fits {
            StringStep::Continue {
                escape,
                utf8: pending - 1,
                character: false,
            }
        } else {
            StringStep::Invalid
        };
    }
    let plain = |escape: u8| StringStep::Continue {
        escape,
        utf8: 0,
        character: false,
    };
    match (escape, b) {
        (ESC_NONE, b'"') => StringStep::Close,
        (ESC_NONE, b'\\') => StringStep::Continue {
            escape: ESC_BACKSLASH,
            utf8: 0,
            character: true,
        },
        (ESC_NONE, 0..=0x1f) => StringStep::Invalid,
        (ESC_NONE, 0x20..=0x7f) => StringStep::Continue {
            escape: ESC_NONE,
            utf8: 0,
            character: true,
        },
        (ESC_NONE, _) => match utf8_lead(b) {
            Some(utf8) => StringStep::Continue {
                escape: ESC_NONE,
                utf8,
                character: true,
            },
            None => StringStep::Invalid,
        },
        (ESC_BACKSLASH, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => plain(ESC_NONE),
        (ESC_BACKSLASH, b'u') => plain(ESC_HEX_BASE + 4),
        (e, b) if e > ESC_HEX_BASE && b.is_ascii_hexdigit() => plain(if e == ESC_HEX_BASE + 1 {
            ESC_NONE
        } else {
            e - 1
        }),
        _ => StringStep::Invalid,
    }
}

/// A tokenizer's tokens as bytes: one a tokenizer, shared by every constraint over it.
pub struct JsonVocabulary {
    /// Each token's bytes; None for tokens that never appear in JSON output (special tokens that do not stop).
    tokens: Vec<Option<Box<[u8]>>>,
    /// Tokens by their first byte (a state that refuses the byte refuses them all).
    by_first_byte: Vec<Vec<u32>>,
    /// Sorted.
    stop: Vec<u32>,
}

impl JsonVocabulary {
    pub fn new(tokenizer: &Tokenizer) -> Arc<Self> {
        let special = tokenizer.special_tokens();
        let tokens = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                (!bytes.is_empty() && special.binary_search(&id).is_err())
                    .then(|| bytes.into_boxed_slice())
            })
            .collect();
        Self::from_tokens(tokens, tokenizer.stop_tokens().to_vec())
    }

    /// From tokens' bytes directly (None: never allowed) and the stop tokens.
    pub fn from_tokens(tokens: Vec<Option<Box<[u8]>>>, mut stop: Vec<u32>) -> Arc<Self> {
        stop.sort_unstable();
        stop.dedup();
        let mut by_first_byte = vec![Vec::new(); 256];
        for (t, bytes) in tokens.iter().enumerate() {
            if let Some(&first) = bytes.as_deref().and_then(|b| b.first()) {
                if stop.binary_search(&(t as u32)).is_err() {
                    by_first_byte[first as usize].push(t as u32);
                }
            }
        }
        Arc::new(JsonVocabulary {
            tokens,
            by_first_byte,
            stop,
        })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    fn is_stop(&self, token: u32) -> bool {
        self.stop.binary_search(&token).is_ok()
    }
}

impl PartialEq for JsonVocabulary {
    fn eq(&self, other: &Self) -> bool {
        self.tokens == other.tokens && self.stop == other.stop
    }
}

impl std::fmt::Debug for JsonVocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonVocabulary")
            .field("tokens", &self.tokens.len())
            .field("stop", &self.stop)
            .finish()
    }
}

/// A grammar over a vocabulary, with the masks of the states met so far: shared by every request with the same
/// `response_format` (the server keeps one for json_object and one for each recent schema).
pub struct JsonConstraint {
    grammar: JsonGrammar,
    vocab: Arc<JsonVocabulary>,
    /// Each path's mask, by the path.
    masks: Mutex<HashMap<Path, Arc<[u64]>>>,
}

impl JsonConstraint {
    pub fn new(grammar: JsonGrammar, vocab: Arc<JsonVocabulary>) -> Arc<Self> {
        Arc::new(JsonConstraint {
            grammar,
            vocab,
            masks: Mutex::new(HashMap::new()),
        })
    }

    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.vocab.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vocab.is_empty()
    }

    pub fn grammar(&self) -> &JsonGrammar {
        &self.grammar
    }

    /// The state after `token`: stop tokens leave it as it is; None where the token leaves the language.
    pub fn advance(&self, state: JsonState, token: u32) -> Option<JsonState> {
        if self.vocab.is_stop(token) {
            return self.grammar.may_end(state).then_some(state);
        }
        self.grammar
            .after(state, self.vocab.tokens.get(token as usize)?.as_deref()?)
    }

    /// The tokens allowed in `state`, one bit each (bit t % 64 of word t / 64): those some path of it allows.
    pub fn mask(&self, state: JsonState) -> Arc<[u64]> {
        match state.paths() {
            [one] => self.path_mask(one),
            paths => {
                let mut mask = vec![0u64; self.vocab.tokens.len().div_ceil(64)];
                for p in paths {
                    for (m, w) in mask.iter_mut().zip(self.path_mask(p).iter()) {
                        *m |= w;
                    }
                }
                mask.into()
            }
        }
    }

    /// The tokens one path allows, computed once (kept for `MASK_CACHE_STATES` paths).
    fn path_mask(&self, path: &Path) -> Arc<[u64]> {
        if let Some(mask) = self
            .masks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(path)
        {
            return mask.clone();
        }
        let mut mask = vec![0u64; self.vocab.tokens.len().div_ceil(64)];
        if self.grammar.path_may_end(path) {
            for &t in &self.vocab.stop {
                if (t as usize) < self.vocab.tokens.len() {
                    mask[t as usize / 64] |= 1 << (t % 64);
                }
            }
        }
        if !path.is_done() {
            // Inside a string most tokens stay inside it: those are judged by the string's own few bytes of
            // state, and only tokens that close it walk the whole grammar.
            let string = self.grammar.string_scan(path);
            let (mut after_first, mut paths, mut scratch) = (Vec::new(), Vec::new(), Vec::new());
            for first in 0..=255u8 {
                after_first.clear();
                after_first.push(*path);
                if !self.grammar.walk(&mut after_first, &mut scratch, &[first]) {
                    continue;
                }
                for &t in &self.vocab.by_first_byte[first as usize] {
                    let bytes = self.vocab.tokens[t as usize]
                        .as_deref()
                        .expect("indexed tokens have bytes");
                    let allowed = match string.map(|s| s.run(bytes)) {
                        Some(Some(inside)) => inside,
                        _ => {
                            self.grammar
                                .takes(&after_first, &bytes[1..], &mut paths, &mut scratch)
                        }
                    };
                    if allowed {
                        mask[t as usize / 64] |= 1 << (t % 64);
                    }
                }
            }
        }
        let mask: Arc<[u64]> = mask.into();
        let mut masks = self.masks.lock().unwrap_or_else(|e| e.into_inner());
        if masks.len() >= MASK_CACHE_STATES {
            masks.clear();
        }
        masks.insert(*path, mask.clone());
        mask
    }

    /// Sets the logits of the tokens `state` does not allow to minus infinity. Errors where it allows none (a
    /// vocabulary without the bytes the output needs), rather than sampling from nothing.
    pub fn apply(&self, state: JsonState, logits: &mut [f32]) -> Result<()> {
        let mask = self.mask(state);
        let mut any = false;
        // Rows past the tokenizer's vocabulary (a model's padded embedding rows) are never allowed.
        let words = mask.iter().copied().chain(std::iter::repeat(0));
        for (chunk, word) in logits.chunks_mut(64).zip(words) {
            any |= word != 0;
            if word == u64::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if word >> i & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if !any {
            return Err(Error::InvalidArgument(
                "JSON output: no token of this vocabulary continues the output here".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Debug for JsonConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonConstraint")
            .field("nodes", &self.grammar.nodes.len())
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl PartialEq for JsonConstraint {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn any_object() -> &'static JsonGrammar {
        static G: std::sync::OnceLock<JsonGrammar> = std::sync::OnceLock::new();
        G.get_or_init(JsonGrammar::any_object)
    }

    fn accepts(text: &str) -> Option<JsonState> {
        any_object().after(JsonState::default(), text.as_bytes())
    }

    fn schema(s: Value) -> JsonGrammar {
        JsonGrammar::from_schema(&s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    /// Whether `g` takes `text` whole (complete, nothing more expected).
    fn whole(g: &JsonGrammar, text: &str) -> bool {
        g.after(JsonState::default(), text.as_bytes())
            .is_some_and(|s| s.is_done())
    }

    /// Every prefix of `text` is taken and none but the whole is complete.
    fn every_prefix(g: &JsonGrammar, text: &str) {
        for end in 0..text.len() {
            let state = g
                .after(JsonState::default(), &text.as_bytes()[..end])
                .unwrap_or_else(|| panic!("{:?} refused", &text[..end]));
            assert!(!state.is_done(), "{:?} is not whole", &text[..end]);
        }
        assert!(whole(g, text), "{text} refused");
    }

    #[test]
    fn whole_objects_are_accepted_and_done() {
        for doc in [
            "{}",
            " \n{ } ",
            r#"{"a": 1, "b": [true, false, null, -0.5e+10, 0, 12.25E3], "c": {"d": "x\"\\\/\b\f\n\r\t\u00e9"}}"#,
            r#"{"nested": [[[]], {}, [{"k": []}]], "s": "héllo ✓"}"#,
            "{\n  \"pretty\": [\n    1,\n    2\n  ]\n}",
        ] {
            // Whitespace after the object is refused: only a stop token may follow.
            let trimmed = doc.trim_end();
            if trimmed.len() < doc.len() {
                assert!(accepts(doc).is_none(), "{doc:?} was accepted");
            }
            let state = accepts(trimmed).unwrap_or_else(|| panic!("{doc} was refused"));
            assert!(state.is_done(), "{doc}");
            assert!(serde_json::from_str::<serde_json::Value>(doc).is_ok());
        }
    }

    #[test]
    fn prefixes_are_accepted_and_not_done() {
        every_prefix(
            any_object(),
            r#"{"a": [1.5, "x\u00e9", {"b": null}], "c": -3}"#,
        );
    }

    #[test]
    fn invalid_json_is_refused_at_the_first_wrong_byte() {
        for (doc, valid_prefix) in [
            ("[1]", ""),                  // the top level must be an object
            ("\"s\"", ""),                // so must this
            ("{a: 1}", "{"),              // keys are strings
            ("{\"a\" 1}", "{\"a\" "),     // a colon between key and value
            ("{\"a\": 01}", "{\"a\": 0"), // no leading zeros
            ("{\"a\": 1.}", "{\"a\": 1."),
            ("{\"a\": -}", "{\"a\": -"),
            ("{\"a\": tru}", "{\"a\": tru"),
            ("{\"a\": 1,}", "{\"a\": 1,"),
            ("{\"a\": [1,]}", "{\"a\": [1,"),
            ("{\"a\": [1}", "{\"a\": [1"),
            ("{\"a\": \"\\x\"}", "{\"a\": \"\\"),
            ("{\"a\": \"\\u12g4\"}", "{\"a\": \"\\u12"),
            ("{\"a\": \"tab\there\"}", "{\"a\": \"tab"),
            ("{} {}", "{}"),
            ("{}}", "{}"),
        ] {
            assert!(accepts(doc).is_none(), "{doc} was accepted");
            let prefix = accepts(valid_prefix).unwrap_or_else(|| panic!("{valid_prefix} refused"));
            let bad = doc.as_bytes()[valid_prefix.len()];
            assert!(
                any_object().after(prefix, &[bad]).is_none(),
                "{doc}: byte {:?} after {valid_prefix}",
                bad as char
            );
        }
    }

    /// Strings hold well-formed UTF-8 only (what JSON parsers take), split across tokens or not, and a
    /// character of several bytes counts once against maxLength.
    #[test]
    fn strings_hold_well_formed_utf8() {
        let any = any_object();
        let start = any.after(JsonState::default(), br#"{"k": ""#).unwrap();
        for good in ["é", "✓", "😀", "aé✓😀z", "\\u00e9"] {
            let s = any
                .after(start, good.as_bytes())
                .unwrap_or_else(|| panic!("{good}"));
            assert!(any.after(s, b"\"}").unwrap().is_done(), "{good}");
        }
        for bad in [
            &b"\xff"[..],
            b"\x80",             // a continuation byte first
            b"\xc0\x80",         // overlong
            b"\xe0\x80\x80",     // overlong
            b"\xed\xa0\x80",     // a surrogate
            b"\xf4\x90\x80\x80", // past U+10FFFF
            b"\xc3\"",           // cut short by the quote
            b"\xe2\x9c\"",
        ] {
            assert!(any.after(start, bad).is_none(), "{bad:?}");
        }
        // Keys of any-key objects too.
        let key = any.after(JsonState::default(), b"{\"").unwrap();
        assert!(any.after(key, "é\": 1}".as_bytes()).unwrap().is_done());
        assert!(any.after(key, b"\xc3\": 1}").is_none());
        let g = schema(
            json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}}),
        );
        assert!(whole(&g, r#"{"s": "é😀"}"#));
        assert!(!whole(&g, r#"{"s": "é😀a"}"#));
        // Unbounded strings and arrays keep no count, so their states (and masks) repeat; bounded ones count.
        assert_eq!(
            any.after(start, b"ab"),
            any.after(start, "abcdefé".as_bytes())
        );
        let items = any.after(JsonState::default(), br#"{"k": [1, "#).unwrap();
        assert_eq!(any.after(items, b"2, "), any.after(items, b"2, 3, 4, "));
        let g = schema(json!({"type": "object", "properties": {
            "s": {"type": "string", "minLength": 2},
            "a": {"type": "array", "maxItems": 3}
        }}));
        let s = g.after(JsonState::default(), br#"{"s": ""#).unwrap();
        assert_ne!(g.after(s, b"a"), g.after(s, b"ab"));
        assert_eq!(g.after(s, b"ab"), g.after(s, b"abcd"));
        let a = g.after(JsonState::default(), br#"{"a": [1, "#).unwrap();
        assert_ne!(g.after(a, b"2, "), g.after(a, b"2, 3, "));
        assert!(g.after(a, b"2, 3, 4").is_none());
    }

    #[test]
    fn depth_and_whitespace_runs_are_bounded() {
        // The object, then MAX_DEPTH - 1 arrays: every frame in use once the innermost array is open.
        let deep = format!("{{\"a\": {}", "[".repeat(MAX_DEPTH - 1));
        let state = accepts(&deep).unwrap();
        assert!(any_object().after(state, b"[").is_none());
        assert!(any_object().after(state, b"1").is_none());
        assert!(any_object().after(state, b"]").is_some());
        let spaces = " ".repeat(MAX_WHITESPACE_RUN as usize);
        assert!(accepts(&format!("{{{spaces}")).is_some());
        assert!(accepts(&format!("{{{spaces} ")).is_none());
        // A run ends at any other byte.
        assert!(accepts(&format!("{{{spaces}\"a\":{spaces}1{spaces}}}")).is_some());
    }

    #[test]
    fn a_schema_fixes_keys_their_order_and_their_values() {
        let g = schema(json!({
            "type": "object",
            "title": "a person",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 5, "description": "given name"},
                "age": {"type": "integer"},
                "email": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
                "ok": {"type": "boolean"},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "ok"],
            "additionalProperties": false
        }));
        for good in [
            r#"{"name": "Tom", "age": 3, "ok": true}"#,
            r#"{"name":"Tomé","age":-12,"email":null,"tags":["a",3],"ok":false,"score":1.5e3}"#,
            r#"{"name": "\u00e9x", "age": 0, "email": "t@x", "ok": true, "score": -0.25}"#,
            "{\n  \"name\": \"A\",\n  \"age\": 7,\n  \"tags\": [\"b\"],\n  \"ok\": true\n}",
        ] {
            assert!(whole(&g, good), "{good} refused");
            every_prefix(&g, good);
        }
        for bad in [
            r#"{"age": 3, "name": "Tom", "ok": true}"#, // out of order
            r#"{"name": "Tom", "ok": true}"#,           // age is required
            r#"{"name": "Tom", "age": 3}"#,             // ok is required
            r#"{"name": "", "age": 3, "ok": true}"#,    // minLength 1
            r#"{"name": "Tomasz", "age": 3, "ok": true}"#, // maxLength 5
            r#"{"name": "Tom", "age": 3.5, "ok": true}"#, // an integer
            r#"{"name": "Tom", "age": 1e3, "ok": true}"#,
            r#"{"name": "Tom", "age": 3, "tags": [], "ok": true}"#, // minItems 1
            r#"{"name": "Tom", "age": 3, "tags": ["a", "b", "a"], "ok": true}"#, // maxItems 2
            r#"{"name": "Tom", "age": 3, "tags": ["c"], "ok": true}"#, // not in the enum
            r#"{"name": "Tom", "age": 3, "tags": [33], "ok": true}"#,
            r#"{"name": "Tom", "age": 3, "ok": 1}"#,
            r#"{"name": "Tom", "age": 3, "ok": true, "extra": 1}"#,
            r#"{"name": "Tom", "age": 3, "ok": true, "name": "x"}"#,
            r#"{"name": "Tom", "age": 3, "email": 5, "ok": true}"#,
        ] {
            assert!(!whole(&g, bad), "{bad} accepted");
            assert!(serde_json::from_str::<Value>(bad).is_ok(), "{bad} is JSON");
        }
        // The schema's order, not the alphabet's.
        let s = g
            .after(JsonState::default(), br#"{"name": "T", "a"#)
            .unwrap();
        assert!(g.after(s, b"ge").is_some());
        assert!(g.after(JsonState::default(), br#"{"ok""#).is_none());
    }

    #[test]
    fn definitions_nest_and_recurse_through_refs() {
        let g = schema(json!({
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
                    },
                    "required": ["value"]
                }
            },
            "$ref": "#/$defs/node"
        }));
        let tree = r#"{"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4, "children": []}]}]}"#;
        every_prefix(&g, tree);
        assert!(!whole(
            &g,
            r#"{"value": 1, "children": [{"children": []}]}"#
        ));
        // An object with no properties takes any keys of additionalProperties' values; false leaves it empty.
        let g = schema(json!({
            "type": "object",
            "properties": {
                "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                "none": {"type": "object", "additionalProperties": false},
                "any": {}
            }
        }));
        assert!(whole(
            &g,
            r#"{"counts": {"a": 1, "b\"": -2}, "none": {}, "any": [1, {"x": null}]}"#
        ));
        assert!(!whole(&g, r#"{"counts": {"a": "1"}}"#));
        assert!(!whole(&g, r#"{"none": {"a": 1}}"#));
        assert!(whole(&g, "{}"));
    }

    #[test]
    fn unsupported_or_contradictory_schemas_are_refused_by_name() {
        for (s, needle) in [
            (json!({"type": "string"}), "root must be an object"),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}),
                "properties.a cannot be enforced: look-around",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "format": "color"}}}),
                "\"color\" is not supported (supported: date-time",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{5}$", "maxLength": 3}}}),
                "at most maxLength 3",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "exclusiveMaximum": 5}}}),
                "no number lies",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 0.5}}}),
                "no value matches",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.3}}}),
                "multipleOf 0.3",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "maximum": 1e300}}}),
                "2^53",
            ),
            // Found by the output-constraint fuzz target: a whole multipleOf this large saturated to u64::MAX and
            // built a broken automaton (an index panic).
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 1e300}}}),
                "multipleOf 1e+300 is not supported",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 1e9}}}),
                "multipleOf 1000000000 is not supported",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": true}}}),
                "minimum is missing",
            ),
            (
                json!({"type": "object", "properties": (
                    (0..40).map(|i| (format!("p{i}"), json!({"type": "string", "pattern": format!("^[a-z]{{{}}}$", 1000 + i)})))
                        .collect::<serde_json::Map<String, Value>>()
                )}),
                "automaton states together",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "uniqueItems": true}}}),
                "uniqueItems is supported only for items given by enum",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": true, "minItems": 3}}}),
                "minItems 3 is more than its 2 distinct values",
            ),
            (
                json!({"type": "object", "patternProperties": {"^x": {}, "^y": {}}}),
                "patternProperties must be an object of one pattern",
            ),
            (
                json!({"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}),
                "both properties and patternProperties",
            ),
            (
                json!({"type": "object", "propertyNames": {"type": "integer"}}),
                "propertyNames must describe strings",
            ),
            (
                json!({"type": "object", "properties": {"ab": {}}, "propertyNames": {"maxLength": 1}}),
                "property \"ab\" does not match",
            ),
            (
                json!({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}),
                "minProperties 2 on an object of free keys",
            ),
            (
                json!({"type": "object", "minProperties": 3, "maxProperties": 2}),
                "minProperties 3 is more than maxProperties 2",
            ),
            (
                json!({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1}),
                "requires 2 properties but maxProperties is 1",
            ),
            (
                json!({"type": "object", "properties": {"a": {}}, "minProperties": 2}),
                "minProperties 2 is more than the 1 properties",
            ),
            (
                json!({"type": "object", "required": ["b"], "properties": {"a": {}}}),
                "\"b\"",
            ),
            (
                json!({"type": "object", "properties": {"a": {"oneOf": [{"type": "object"}, {"type": "object", "properties": {}}]}}}),
                "schema.properties.a.oneOf: alternatives 0 and 1 can both match",
            ),
            (
                json!({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}),
                "alternatives 0 and 1 can both match",
            ),
            (
                // Required in both, but the values may be equal (1 and 1.0 are one number).
                json!({"type": "object", "properties": {"a": {"oneOf": [
                    {"properties": {"k": {"const": 1}}, "required": ["k"]},
                    {"properties": {"k": {"enum": [2, 1.0]}}, "required": ["k"]}
                ]}}}),
                "alternatives 0 and 1 can both match",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": (0..9).map(|i| json!({"properties": {format!("k{i}"): {}}})).collect::<Vec<_>>()}}}),
                "9 alternatives can begin with '{'; at most 8",
            ),
            (
                json!({"anyOf": [{"type": "object"}, {"type": "string"}]}),
                "root must be an object",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
                "\"strin\"",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
                "points at nothing",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}),
                "only references inside",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{}], "items": false, "minItems": 2}}}),
                "tuple's 1 positions",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}}),
                "above",
            ),
            (
                json!({"type": "object", "properties": {"a": false}}),
                "nothing matches",
            ),
            (
                json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}),
                "itself",
            ),
            (
                json!({"type": "object", "properties": {"a": {"enum": []}}}),
                "non-empty",
            ),
            (
                json!({"type": "object", "properties": {"a": {"allOf": [{}, {}]}}}),
                "allOf",
            ),
        ] {
            let e = JsonGrammar::from_schema(&s)
                .expect_err(&s.to_string())
                .to_string();
            assert!(e.contains(needle), "{s}: {e}");
            assert!(e.starts_with("invalid argument: json_schema:"), "{e}");
        }
    }

    #[test]
    fn patterns_formats_and_bounds_shape_values() {
        let g = schema(json!({
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
                "day": {"type": "string", "format": "date"},
                "mail": {"type": ["string", "null"], "format": "email", "maxLength": 12},
                "n": {"type": "integer", "minimum": -3, "exclusiveMaximum": 100, "multipleOf": 3},
                "price": {"type": "number", "minimum": 0, "multipleOf": 0.01},
                "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "temp": {"type": "number", "minimum": -0.5, "exclusiveMaximum": 1.25},
                "ids": {"type": "array", "items": {"type": "integer", "minimum": 1}}
            }
        }));
        for good in [
            r#"{"code": "AB-12", "day": "2024-02-29", "mail": "a@b.co", "n": -3, "price": 9.99, "ratio": 0.5, "ids": [1, 20]}"#,
            r#"{"mail": null, "n": 99 , "ratio": 1}"#,
            r#"{"n": 0, "price": 0, "ids": [7]}"#,
            r#"{"ratio": 1.000}"#,
            r#"{"ratio": 0.001, "temp": -0.5}"#,
            r#"{"temp": 1.2499}"#,
        ] {
            every_prefix(&g, good);
        }
        for bad in [
            r#"{"code": "ab-12"}"#,
            r#"{"code": "AB-"}"#,
            r#"{"code": "AB-1\u0031"}"#,
            r#"{"day": "2023-02-29"}"#,
            r#"{"mail": "a@b..c"}"#,
            r#"{"mail": "abcdefgh@ij.kl"}"#,
            r#"{"n": 100}"#,
            r#"{"n": 4}"#,
            r#"{"n": -6}"#,
            r#"{"n": 3.0}"#,
            r#"{"price": 1.234}"#,
            r#"{"price": -1}"#,
            r#"{"price": 1e2}"#,
            r#"{"ratio": 0}"#,
            r#"{"ratio": 1.01}"#,
            r#"{"temp": -0.51}"#,
            r#"{"temp": 1.25}"#,
            r#"{"temp": 1.250}"#,
            r#"{"ids": [0]}"#,
        ] {
            assert!(!whole(&g, bad), "{bad} taken");
        }
        // A value is refused at its first byte no valid value continues: the prefix of a number past its bound.
        // ("1" may become 12 or 15; "10" only 100 and on, past the bound, or 10 itself, no multiple of 3.)
        assert!(g.after(JsonState::default(), br#"{"n": 1"#).is_some());
        assert!(g.after(JsonState::default(), br#"{"n": 10"#).is_none());
        assert!(g.after(JsonState::default(), br#"{"n": 99"#).is_some());
        assert!(g.after(JsonState::default(), br#"{"n": 990"#).is_none());
        assert!(g.after(JsonState::default(), br#"{"code": "A1"#).is_none());
        // A length bound too long for the product is counted in the frame (pydantic's HttpUrl: a uri of at most
        // 2083 characters), and a byte is refused once the value could not end within the bound.
        let url = schema(json!({"type": "object", "properties": {
            "site": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 300},
            "mail": {"type": "string", "format": "email", "maxLength": 320}}}));
        let base = "https://x.io/";
        let full = format!("{base}{}", "a".repeat(300 - base.len()));
        every_prefix(&url, &format!(r#"{{"site": "{full}"}}"#));
        assert!(!whole(&url, &format!(r#"{{"site": "{full}a"}}"#)));
        let almost = format!(r#"{{"site": "{base}{}"#, "a".repeat(300 - base.len() - 3));
        let s = url.after(JsonState::default(), almost.as_bytes()).unwrap();
        // After 297 characters "a%" cannot end in time (299 + 2 more > 300); "%4F" ends at 300.
        assert!(url.after(s, b"a%").is_none());
        assert!(url.after(s, b"%4F\"}").is_some_and(|s| s.is_done()));
        every_prefix(&url, r#"{"mail": "a@b.co"}"#);
        // A pattern whose values are all longer than maxLength, or possibly shorter than minLength beside a long
        // maxLength, is refused by name.
        for (bad, needle) in [
            (
                json!({"type": "string", "pattern": "^a{400}$", "maxLength": 300}),
                "no value of its pattern",
            ),
            (
                json!({"type": "string", "pattern": "^a+$", "minLength": 5, "maxLength": 300}),
                "minLength 5",
            ),
        ] {
            let e = JsonGrammar::from_schema(&json!({"type": "object", "properties": {"x": bad}}))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{e}");
        }
        // The same description compiles to one automaton.
        let twice = schema(json!({"type": "object", "properties": {
            "a": {"type": "string", "format": "uuid"}, "b": {"type": "string", "format": "uuid"}}}));
        assert_eq!(twice.dfas.len(), 1);
    }

    #[test]
    fn unique_items_of_a_set_of_choices_never_repeat() {
        let g = schema(json!({"type": "object", "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", 1, 12]}, "uniqueItems": true},
            "two": {"type": "array", "items": {"$ref": "#/$defs/c"}, "uniqueItems": true, "minItems": 2}
        }, "$defs": {"c": {"enum": [true, false]}}}));
        for good in [
            r#"{"tags": ["red", 12, 1, "green"]}"#,
            r#"{"tags": [1, 12]}"#,
            r#"{"tags": []}"#,
            r#"{"two": [false, true]}"#,
        ] {
            every_prefix(&g, good);
        }
        for bad in [
            r#"{"tags": ["red", "red"]}"#,
            r#"{"tags": [12, 1, 12]}"#,
            r#"{"tags": [1, 1]}"#,
            r#"{"tags": ["red", "green", 1, 12, "red"]}"#,
            r#"{"two": [true]}"#,
            r#"{"two": [true, true]}"#,
        ] {
            assert!(!whole(&g, bad), "{bad} taken");
        }
        // A used choice is refused at its first byte that no unused choice shares.
        assert!(g
            .after(JsonState::default(), br#"{"tags": ["red", "r"#)
            .is_none());
        assert!(g
            .after(JsonState::default(), br#"{"tags": [12, 1"#)
            .is_some());
        assert!(g
            .after(JsonState::default(), br#"{"tags": [1, 12, 1"#)
            .is_none());
    }

    #[test]
    fn tuples_take_each_position_then_the_rest() {
        let g = schema(json!({"type": "object", "properties": {
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false, "minItems": 2},
            "head": {"type": "array", "items": [{"type": "boolean"}], "additionalItems": {"type": "null"}},
            "open": {"type": "array", "prefixItems": [{"const": "a"}, {"const": "b"}, {"const": "c"}]}
        }}));
        for good in [
            r#"{"pair": [1, "a"]}"#,
            r#"{"head": [true, null, null]}"#,
            r#"{"head": []}"#,
            r#"{"open": ["a", "b", "c", 7, {"x": 1}]}"#,
            r#"{"open": ["a"]}"#,
        ] {
            every_prefix(&g, good);
        }
        for bad in [
            r#"{"pair": [1]}"#,
            r#"{"pair": ["a", 1]}"#,
            r#"{"pair": [1, "a", 2]}"#,
            r#"{"head": [null]}"#,
            r#"{"head": [true, false]}"#,
            r#"{"open": ["a", "c"]}"#,
        ] {
            assert!(!whole(&g, bad), "{bad} taken");
        }
    }

    /// A small vocabulary whose words cover keys, values and structure.
    #[test]
    fn unions_that_begin_alike_are_followed_until_the_bytes_tell_them_apart() {
        // pydantic's Union[Cat, Dog]: two objects under anyOf, through $defs.
        let pets = schema(json!({
            "$defs": {
                "Cat": {"type": "object", "properties": {"name": {"type": "string"}, "meows": {"type": "integer"}}, "required": ["name", "meows"]},
                "Dog": {"type": "object", "properties": {"name": {"type": "string"}, "barks": {"type": "boolean"}}, "required": ["name"]}
            },
            "type": "object",
            "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}, {"type": "null"}]}},
            "required": ["pet"]
        }));
        for good in [
            r#"{"pet": {"name": "Tom", "meows": 3}}"#,
            r#"{"pet": {"name": "Rex", "barks": true}}"#,
            r#"{"pet": {"name": "Rex"}}"#,
            r#"{"pet": null}"#,
        ] {
            every_prefix(&pets, good);
        }
        for bad in [
            r#"{"pet": {"name": "Tom", "meows": 3, "barks": true}}"#,
            r#"{"pet": {"name": "Tom", "barks": 3}}"#,
            r#"{"pet": {"meows": 3}}"#,
            r#"{"pet": {}}"#,
        ] {
            assert!(!whole(&pets, bad), "{bad} taken");
        }
        // Both paths live through the shared key, one after the key that tells them apart.
        let paths = |g: &JsonGrammar, text: &str| {
            g.after(JsonState::default(), text.as_bytes())
                .map(|s| s.count)
        };
        assert_eq!(paths(&pets, r#"{"pet": {"name": "T"#), Some(2));
        assert_eq!(paths(&pets, r#"{"pet": {"name": "Tom", "m"#), Some(1));
        assert_eq!(
            paths(&pets, r#"{"pet": {"name": "Tom", "meows": 3}}"#),
            Some(1)
        );

        // A discriminated union (pydantic's oneOf + discriminator) at the root; the const tells them apart.
        let shapes = schema(json!({
            "oneOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}, "required": ["kind", "r"]},
                {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}}, "required": ["kind", "side"]}
            ],
            "discriminator": {"propertyName": "kind"}
        }));
        every_prefix(&shapes, r#"{"kind": "circle", "r": 2.5}"#);
        every_prefix(&shapes, r#"{"kind": "square", "side": 1}"#);
        assert!(!whole(&shapes, r#"{"kind": "circle", "side": 1}"#));
        assert!(!whole(&shapes, r#"{"r": 1}"#));
        // oneOf alternatives told apart by additionalProperties: false.
        let closed = schema(json!({"type": "object", "properties": {"v": {"oneOf": [
            {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": false},
            {"type": "object", "properties": {"b": {}}, "required": ["b"], "additionalProperties": false}
        ]}}}));
        assert!(whole(&closed, r#"{"v": {"a": 1}}"#) && whole(&closed, r#"{"v": {"b": [2]}}"#));
        assert!(!whole(&closed, r#"{"v": {}}"#));

        // Scalars alike: two formats of a string, and integer beside number.
        let scalars = schema(json!({"type": "object", "properties": {
            "when": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "email"}]},
            "n": {"type": ["integer", "number"]}
        }}));
        for good in [
            r#"{"when": "2024-01-31"}"#,
            r#"{"when": "a@b.io"}"#,
            r#"{"n": 12}"#,
            r#"{"n": -1.5e3}"#,
        ] {
            every_prefix(&scalars, good);
        }
        assert!(
            !whole(&scalars, r#"{"when": "2024-01-3"}"#) && !whole(&scalars, r#"{"when": "a@"}"#)
        );

        // A recursive union: a tree whose nodes are leaves or lists of nodes stays at two paths however deep.
        let tree = schema(json!({
            "$defs": {"t": {"anyOf": [
                {"type": "object", "properties": {"leaf": {"type": "integer"}}, "required": ["leaf"]},
                {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "required": ["kids"]}
            ]}},
            "type": "object", "properties": {"root": {"$ref": "#/$defs/t"}}, "required": ["root"]
        }));
        let deep = format!(
            r#"{{"root": {}{{"leaf": 1}}{}}}"#,
            r#"{"kids": ["#.repeat(12),
            "]}".repeat(12)
        );
        every_prefix(&tree, &deep);
        let mut text = String::new();
        for part in deep.split_inclusive('{') {
            text.push_str(part);
            let n = paths(&tree, &text).expect("a prefix");
            assert!(n <= 2, "{n} paths after {text}");
        }

        // Nested unions that would make more than MAX_PATHS paths keep the first ones: what is written still
        // matches, and no prefix is a dead end.
        let three = |inner: Value| {
            json!({"anyOf": [
                {"type": "object", "properties": {"x": inner.clone(), "a": {}}},
                {"type": "object", "properties": {"x": inner.clone(), "b": {}}},
                {"type": "object", "properties": {"x": inner, "c": {}}}
            ]})
        };
        let wide = schema(
            json!({"type": "object", "properties": {"v": three(three(json!({"type": "integer"})))}}),
        );
        let state = wide
            .after(JsonState::default(), br#"{"v": {"x": {"#)
            .expect("taken");
        assert_eq!(state.count as usize, MAX_PATHS);
        assert!(whole(&wide, r#"{"v": {"x": {"x": 1, "a": 2}, "a": 3}}"#));
        assert!(whole(&wide, r#"{"v": {"x": {"x": 1, "b": 2}, "c": 3}}"#));
        // The ninth path (third outer, third inner) was dropped.
        assert!(!whole(&wide, r#"{"v": {"x": {"x": 1, "c": 2}, "c": 3}}"#));
    }

    #[test]
    fn property_names_patterns_and_counts_shape_objects() {
        // pydantic's dict[Literal["x", "y"], int], dict[constr(pattern=...), float] and a bounded dict.
        let g = schema(json!({"type": "object", "properties": {
            "lit": {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["x", "y"]}},
            "pat": {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "number"}}, "propertyNames": {"maxLength": 3}},
            "some": {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1, "maxProperties": 2},
            "listed": {"type": "object", "properties": {"a": {}, "b": {}, "c": {"type": "integer"}, "d": {}},
                       "required": ["c"], "minProperties": 2, "maxProperties": 3}
        }}));
        for good in [
            r#"{"lit": {"x": 1, "y": 2}}"#,
            r#"{"pat": {"abc": 1.5, "z": 0}}"#,
            r#"{"some": {"k": true}}"#,
            r#"{"some": {"k": true, "\u00e9": false}}"#,
            r#"{"listed": {"a": 1, "c": 2}}"#,
            r#"{"listed": {"c": 2, "d": null}}"#,
            r#"{"listed": {"a": 1, "b": 2, "c": 3}}"#,
        ] {
            every_prefix(&g, good);
        }
        for bad in [
            r#"{"lit": {"z": 1}}"#,
            r#"{"pat": {"abcd": 1}}"#,
            r#"{"pat": {"A": 1}}"#,
            r#"{"pat": {"a": "s"}}"#,
            r#"{"some": {}}"#,
            r#"{"some": {"a": true, "b": true, "c": true}}"#,
            r#"{"listed": {"c": 2}}"#,
            r#"{"listed": {"a": 1, "b": 2, "c": 3, "d": 4}}"#,
            // After "b" only the required "c" fits in maxProperties 3... and "a", "b", "d" leave no room for it.
            r#"{"listed": {"a": 1, "b": 2, "d": 4}}"#,
        ] {
            assert!(!whole(&g, bad), "{bad} taken");
        }
        // A choice that would make minProperties unreachable is refused at once: after {"d" nothing is left to
        // reach 2 (c, the required one, comes before d).
        assert!(g
            .after(JsonState::default(), br#"{"listed": {"d"#)
            .is_none());
        assert!(g
            .after(JsonState::default(), br#"{"listed": {"c": 1}"#)
            .is_none());
        random_walks(&g, 0x5EED, 200, 160);
    }

    /// `walks` random byte walks through `g` (`testing::random_json_walk`; a dead end fails the test): the
    /// finished ones must parse as JSON. Returns how many finished.
    fn random_walks(g: &JsonGrammar, seed: u64, walks: usize, steps: usize) -> usize {
        let mut x = seed;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as usize
        };
        let alphabet: Vec<u8> = (0x20..0x7f).chain([b'\n']).collect();
        let mut finished = 0;
        for _ in 0..walks {
            let walked = crate::testing::random_json_walk(g, &mut next, steps, &alphabet);
            let Some(text) = walked.unwrap_or_else(|e| panic!("{e}")) else {
                continue;
            };
            finished += 1;
            // (serde_json refuses exponents past f64's range, which JSON's grammar allows.)
            if let Err(e) = serde_json::from_slice::<Value>(&text) {
                assert!(
                    e.to_string().contains("number out of range"),
                    "{:?} is not JSON: {e}",
                    String::from_utf8_lossy(&text)
                );
            }
        }
        finished
    }

    #[test]
    fn union_states_never_lead_nowhere() {
        let inner = json!({"anyOf": [
            {"type": "object", "properties": {"k": {"type": "integer"}, "p": {"type": "string"}}, "required": ["k"]},
            {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}, "q": {"enum": [true, 7]}}},
            {"type": "object", "properties": {"k": {"$ref": "#"}}, "additionalProperties": false},
            {"type": ["integer", "number", "null"]},
            {"type": "string", "pattern": "^[0-9]+$"},
            {"type": "string", "maxLength": 2}
        ]});
        let g = schema(
            json!({"type": "object", "properties": {"u": inner.clone(), "w": {"type": "array", "items": inner, "minItems": 2}}, "required": ["u", "w"]}),
        );
        let finished = random_walks(&g, 0x9E37_79B9_7F4A_7C15, 300, 120);
        assert!(finished >= 30, "only {finished} of 300 walks finished");
    }

    fn vocab(words: &[&str]) -> (Arc<JsonVocabulary>, u32) {
        let mut tokens: Vec<Option<Box<[u8]>>> = words
            .iter()
            .map(|w| Some(w.as_bytes().to_vec().into_boxed_slice()))
            .collect();
        tokens.push(None); // a special token
        let stop = tokens.len() as u32;
        tokens.push(Some(b"<|end|>".to_vec().into_boxed_slice()));
        (JsonVocabulary::from_tokens(tokens, vec![stop]), stop)
    }

    /// A regex constrains the whole output, JSON-free: its first byte included (no whitespace skipped), it may
    /// stop where the regex matches and go on where the regex allows, and must stop where nothing can follow.
    #[test]
    fn a_regex_takes_exactly_its_matches_and_stops_where_they_may_end() {
        let g = JsonGrammar::from_regex("[0-9]{3}-[0-9]{2,3}( ok)?").unwrap();
        let at = |text: &str| g.after(JsonState::default(), text.as_bytes());
        assert!(g.may_end(at("123-45").unwrap()));
        assert!(g.may_end(at("123-456").unwrap()));
        assert!(g.may_end(at("123-456 ok").unwrap()));
        for prefix in ["", "1", "123", "123-", "123-4", "123-45 o"] {
            let state = at(prefix).unwrap_or_else(|| panic!("{prefix:?} begins a match"));
            assert!(!g.may_end(state), "{prefix:?} is not a whole match");
        }
        for refused in [" 123-45", "12a", "123-4567", "123-456 ok!", "123-45\n"] {
            assert!(at(refused).is_none(), "{refused:?} leaves the regex");
        }
        // Whitespace inside the regex is the regex's: read as text, not skipped.
        let spaced = JsonGrammar::from_regex("a b").unwrap();
        assert!(spaced.after(JsonState::default(), b"a").is_some());
        assert!(spaced.after(JsonState::default(), b"a  b").is_none());
        assert!(spaced.may_end(spaced.after(JsonState::default(), b"a b").unwrap()));
        // A regex that matches the empty text may stop at once.
        let optional = JsonGrammar::from_regex("(yes)?").unwrap();
        assert!(optional.may_end(JsonState::default()));

        // Masks: stop tokens where the text may end, continuing tokens where it may go on, nothing else.
        let words = [
            "1", "12", "123", "-", "-4", "45", "6", " ok", " o", "k", "x", " ",
        ];
        let (v, stop) = vocab(&words);
        let c = JsonConstraint::new(g, v);
        let allowed = |state: JsonState| -> Vec<String> {
            let mask = c.mask(state);
            let mut out: Vec<String> = words
                .iter()
                .enumerate()
                .filter(|&(t, _)| mask[t / 64] >> (t % 64) & 1 == 1)
                .map(|(_, w)| w.to_string())
                .collect();
            if mask[stop as usize / 64] >> (stop % 64) & 1 == 1 {
                out.push("<stop>".into());
            }
            out
        };
        let walk = |text: &str| {
            c.grammar()
                .after(JsonState::default(), text.as_bytes())
                .unwrap()
        };
        assert_eq!(allowed(JsonState::default()), ["1", "12", "123", "45", "6"]);
        assert_eq!(allowed(walk("123")), ["-", "-4"]);
        assert_eq!(allowed(walk("123-4")), ["1", "12", "45", "6"]);
        assert_eq!(
            allowed(walk("123-45")),
            ["1", "6", " ok", " o", " ", "<stop>"]
        );
        assert_eq!(allowed(walk("123-456")), [" ok", " o", " ", "<stop>"]);
        assert_eq!(allowed(walk("123-456 ok")), ["<stop>"]);
        assert!(c.advance(walk("123-45"), stop).is_some());
        assert!(c.advance(walk("123-4"), stop).is_none());
    }

    /// Choices are literal texts: regex syntax in them means itself, one may be a prefix of another, and the
    /// output is exactly one of them.
    #[test]
    fn choices_are_matched_literally_and_whole() {
        let choices: Vec<String> = ["yes", "yes please", "a.b (c)", "1+1=2", "naïve"]
            .iter()
            .map(|c| c.to_string())
            .collect();
        let g = JsonGrammar::from_choices(&choices).unwrap();
        let at = |text: &str| g.after(JsonState::default(), text.as_bytes());
        for c in &choices {
            assert!(g.may_end(at(c).unwrap()), "{c:?}");
        }
        assert!(at("yes ").is_some_and(|s| !g.may_end(s)));
        for refused in ["axb (c)", "a.b c", "11=2", "no", "yes!", "naive"] {
            assert!(at(refused).is_none(), "{refused:?} is not a choice");
        }
        let err = |list: &[&str]| {
            JsonGrammar::from_choices(&list.iter().map(|c| c.to_string()).collect::<Vec<_>>())
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[]).contains("empty"), "{}", err(&[]));
        assert!(
            err(&["a", ""]).contains("choice 1 is empty"),
            "{}",
            err(&["a", ""])
        );
        let too_many: Vec<String> = (0..=MAX_CHOICES).map(|i| format!("c{i}")).collect();
        assert!(JsonGrammar::from_choices(&too_many).is_err());
    }

    /// Regexes the automata cannot enforce are refused with the regex and the reason named.
    #[test]
    fn unenforceable_regexes_are_refused_by_name() {
        for (regex, why) in [
            ("(ab", "unclosed group"),
            ("(?=a)b", "look-around"),
            ("(a)\\1", "backreferences"),
            ("[^\\s\\S]", "no value matches"),
        ] {
            let e = JsonGrammar::from_regex(regex).unwrap_err().to_string();
            assert!(e.contains(&format!("{regex:?}")), "{e}");
            assert!(e.to_lowercase().contains(why), "{regex}: {e}");
        }
    }

    #[test]
    fn masks_allow_exactly_the_tokens_that_keep_the_prefix_valid() {
        let words = [
            "{",
            "}",
            "{\"",
            "\":",
            " ",
            "\n",
            "  ",
            "\"",
            "a",
            "key",
            ",",
            ":",
            "[",
            "]",
            "1",
            "0",
            "12",
            "2",
            ".",
            "5",
            "e",
            "-",
            "true",
            "tr",
            "ue",
            "null",
            "\\",
            "u",
            "00",
            "é",
            "\"}",
            "}\n",
            "name",
            "\"name\"",
            "age",
            "\"age\":",
            "Tom",
            "m",
            "b",
            "meows",
            "barks",
            "\"meows\":",
            "\", \"b",
            "\"}}",
            ": {\"",
            "3}}",
            "{\"name\"",
        ];
        let (v, stop) = vocab(&words);
        let person = schema(json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": [true, 12]}}},
            "required": ["name"]
        }));
        let shaped = schema(json!({
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^T[a-z]+$"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name"]
        }));
        // Two objects alike under anyOf (two paths until a key tells them apart) beside null.
        let pets = schema(json!({
            "type": "object",
            "properties": {"pet": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string"}, "meows": {"type": "integer"}}, "required": ["name", "meows"]},
                {"type": "object", "properties": {"name": {"type": "string"}, "barks": {"type": "boolean"}}, "required": ["name"]},
                {"type": "null"}
            ]}},
            "required": ["pet"]
        }));
        for (grammar, prefixes, whole_text) in [
            (
                pets,
                &[
                    "{\"pet\"",
                    "{\"pet\": ",
                    "{\"pet\": {",
                    "{\"pet\": {\"name\": \"Tom",
                    "{\"pet\": {\"name\": \"Tom\"",
                    "{\"pet\": {\"name\": \"Tom\", \"",
                    "{\"pet\": {\"name\": \"Tom\", \"meows\": 3",
                    "{\"pet\": {\"name\": \"Tom\"}}",
                ][..],
                r#"{"pet": {"name": "Tom", "meows": 3}}"#,
            ),
            (
                JsonGrammar::any_object(),
                &[
                    "",
                    "{",
                    "{\"a",
                    "{\"a\":",
                    "{\"a\": 1",
                    "{\"a\": [tr",
                    "{\"a\": \"\\u0",
                    "{}",
                ][..],
                r#"{"name": "Tom"}"#,
            ),
            (
                person,
                &[
                    "",
                    "{",
                    "{\"",
                    "{\"name\": \"T",
                    "{\"name\": \"Tom\"",
                    "{\"name\": \"Tom\",",
                    "{\"name\": \"Tom\", \"age\": 1",
                    "{\"name\": \"Tom\", \"tags\": [1",
                    "{\"name\": \"Tom\", \"tags\": [tr",
                    "{\"name\": \"Tom\"}",
                ][..],
                r#"{"name": "Tom"}"#,
            ),
            (
                shaped,
                &[
                    "{\"name\": \"",
                    "{\"name\": \"T",
                    "{\"name\": \"Tom",
                    "{\"name\": \"Tom\", \"age\": ",
                    "{\"name\": \"Tom\", \"age\": 1",
                    "{\"name\": \"Tom\", \"age\": 12",
                    "{\"name\": \"Tom\", \"age\": 0",
                ][..],
                r#"{"name": "Tom"}"#,
            ),
        ] {
            let constraint = JsonConstraint::new(grammar, v.clone());
            let g = constraint.grammar();
            for prefix in prefixes {
                let state = g
                    .after(JsonState::default(), prefix.as_bytes())
                    .unwrap_or_else(|| panic!("{prefix} refused"));
                let mask = constraint.mask(state);
                for t in 0..constraint.len() {
                    let allowed = mask[t / 64] >> (t % 64) & 1 == 1;
                    let expected = if t as u32 == stop {
                        state.is_done()
                    } else {
                        words
                            .get(t)
                            .is_some_and(|w| g.after(state, w.as_bytes()).is_some())
                    };
                    assert_eq!(allowed, expected, "prefix {prefix:?}, token {t}");
                    assert_eq!(
                        constraint.advance(state, t as u32).is_some(),
                        expected,
                        "prefix {prefix:?}, token {t}"
                    );
                }
                // A model's padded rows past the tokenizer's vocabulary are masked too.
                let mut logits = vec![0.0f32; constraint.len() + 70];
                constraint
                    .apply(state, &mut logits)
                    .unwrap_or_else(|e| panic!("prefix {prefix:?}: {e}"));
                for (t, l) in logits.iter().enumerate() {
                    let allowed = t < constraint.len() && mask[t / 64] >> (t % 64) & 1 == 1;
                    assert_eq!(l.is_finite(), allowed, "prefix {prefix:?}, token {t}");
                }
            }
            // Once done only the stop token is allowed, and it leaves the state as it is.
            let done = g
                .after(JsonState::default(), whole_text.as_bytes())
                .unwrap();
            assert!(done.is_done());
            assert_eq!(constraint.advance(done, stop), Some(done));
            assert_eq!(constraint.advance(JsonState::default(), stop), None);
            assert_eq!(constraint.advance(done, 1), None);
        }
        // A state no token continues is an error, not a row of minus infinities.
        let (lonely, _) = vocab(&["x"]);
        let constraint = JsonConstraint::new(JsonGrammar::any_object(), lonely);
        let mut logits = vec![0.0f32; 3];
        assert!(constraint.apply(JsonState::default(), &mut logits).is_err());
    }

    /// Random schemas (valid, invalid, deep, self-referring) compile or fail with an error, and random bytes
    /// walk any compiled grammar without a panic; what a grammar takes is always a JSON prefix.
    #[test]
    fn random_schemas_and_bytes_never_panic() {
        let mut seed = 0x5eed_u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        fn random_schema(next: &mut dyn FnMut() -> usize, depth: usize) -> Value {
            let leaf = |n: usize| match n % 12 {
                0 => json!({"type": "string", "maxLength": n % 5}),
                9 => {
                    json!({"type": "string", "pattern": (["^a+$", "[0-9]", "x|yz"][n % 3]), "maxLength": n % 7})
                }
                10 => {
                    json!({"type": ["string", "null"], "format": value_regex::FORMATS[n % value_regex::FORMATS.len()]})
                }
                11 => {
                    json!({"type": (["integer", "number"][n % 2]), "minimum": (n as i64 % 13 - 6), "maximum": (n as i64 % 7), "multipleOf": ([1.0, 3.0, 0.1][n % 3])})
                }
                1 => json!({"type": "integer"}),
                2 => json!({"type": "number"}),
                3 => json!({"type": "boolean"}),
                4 => json!({"type": "null"}),
                5 => json!({"enum": ["a", 1, null, [1], {"k": 2}]}),
                6 => json!({"$ref": "#"}),
                7 => json!({"$ref": "#/properties/p0"}),
                _ => json!({"type": ["string", "null"]}),
            };
            if depth == 0 {
                return leaf(next());
            }
            match next() % 6 {
                0 | 1 => {
                    let mut props = serde_json::Map::new();
                    for i in 0..next() % 4 {
                        props.insert(format!("p{i}"), random_schema(next, depth - 1));
                    }
                    let required: Vec<String> = props
                        .keys()
                        .filter(|_| next().is_multiple_of(2))
                        .cloned()
                        .collect();
                    json!({"type": "object", "properties": props, "required": required})
                }
                2 => {
                    json!({"type": "array", "items": random_schema(next, depth - 1), "maxItems": next() % 4})
                }
                3 => {
                    json!({"anyOf": [random_schema(next, depth - 1), random_schema(next, depth - 1)]})
                }
                4 => {
                    json!({"type": "object", "additionalProperties": random_schema(next, depth - 1)})
                }
                _ => leaf(next()),
            }
        }
        let mut compiled = 0;
        for _ in 0..400 {
            let s = random_schema(&mut next, 4);
            let Ok(g) = JsonGrammar::from_schema(&s) else {
                continue;
            };
            compiled += 1;
            for _ in 0..20 {
                let bytes: Vec<u8> = (0..next() % 40)
                    .map(|_| b"{}[]\":, 0123456789.-eEtrufalsn\\\"pkaxyz@T:"[next() % 38])
                    .collect();
                let _ = g.after(JsonState::default(), &bytes);
            }
        }
        assert!(
            compiled > 50,
            "only {compiled} of 400 random schemas compiled"
        );
        // A chain of references deeper than the bound is an error, not a stack overflow.
        let mut defs = serde_json::Map::new();
        for i in 0..500 {
            defs.insert(
                format!("d{i}"),
                json!({"type": "array", "items": {"$ref": format!("#/$defs/d{}", i + 1)}}),
            );
        }
        defs.insert("d500".into(), json!({"type": "string"}));
        let deep =
            json!({"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}});
        let e = JsonGrammar::from_schema(&deep).unwrap_err().to_string();
        assert!(e.contains("nested more than"), "{e}");
    }
}
