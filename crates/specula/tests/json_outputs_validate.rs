//! What constrained JSON output writes matches its schema, as an independent validator (Python's `jsonschema`,
//! formats checked) judges it: for hand-written schemas and random ones over every keyword the compiler enforces,
//! random byte walks through the grammar (each byte drawn from those the state takes) are finished and validated.
//! This checks soundness (nothing written fails the schema); the unit tests check the other direction on chosen
//! texts. scripts/test.sh installs `jsonschema` and sets SPECULA_REQUIRE_JSONSCHEMA, so CI cannot skip this.

use std::io::Write;
use std::process::Command;

use serde_json::{json, Value};
use specula::json_mode::JsonGrammar;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as usize
    }

    fn below(&mut self, n: usize) -> usize {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Bytes a walk may write: printable ASCII, a newline, and the bytes of "é" and "€" (so strings hold multi-byte
/// characters too).
fn alphabet() -> Vec<u8> {
    (0x20..0x7f)
        .chain([b'\n', 0xC3, 0xA9, 0xE2, 0x82, 0xAC])
        .collect()
}

/// A text the grammar takes whole, from random bytes (None where the walk did not finish in `steps` bytes).
fn walk(g: &JsonGrammar, rng: &mut Rng, steps: usize, alphabet: &[u8]) -> Option<String> {
    let text = specula::testing::random_json_walk(g, &mut || rng.next(), steps, alphabet)
        .unwrap_or_else(|e| panic!("{e}"))?;
    Some(String::from_utf8(text).expect("the grammar writes UTF-8"))
}

const PATTERNS: &[&str] = &[
    "^[A-Z][a-z]{1,6}$",
    "^[0-9]{3}-[0-9]{4}$",
    "ab+c",
    "^(cat|dog|bird)s?$",
    "^\\d+(\\.\\d{1,2})?$",
    "x",
];

fn random_schema(rng: &mut Rng, depth: usize) -> Value {
    let leaf = |rng: &mut Rng| -> Value {
        match rng.below(16) {
            0 => json!({"type": "string"}),
            1 => {
                json!({"type": "string", "minLength": rng.below(3), "maxLength": 3 + rng.below(6)})
            }
            2 => json!({"type": "string", "pattern": rng.pick(PATTERNS)}),
            3 => {
                let format = *rng.pick(specula::json_mode::FORMATS);
                json!({"type": "string", "format": format})
            }
            4 => json!({"type": "integer"}),
            5 => {
                let lo = rng.below(200) as i64 - 100;
                json!({"type": "integer", "minimum": lo, "maximum": lo + rng.below(300) as i64})
            }
            6 => {
                json!({"type": "integer", "multipleOf": 1 + rng.below(12), "exclusiveMinimum": -50})
            }
            7 => json!({"type": "number"}),
            8 => json!({"type": "number", "minimum": -2.5, "exclusiveMaximum": 7.25}),
            9 => json!({"type": "number", "multipleOf": 0.01, "maximum": 100}),
            10 => json!({"type": "boolean"}),
            11 => json!({"type": "null"}),
            12 => json!({"enum": ["a", 1, null, [1, "x"], {"k": 2}, 2.5]}),
            13 => json!({"const": "fixed"}),
            14 => json!({"type": ["string", "null"], "maxLength": 4}),
            _ => json!({"type": ["integer", "number", "boolean"]}),
        }
    };
    if depth == 0 {
        return leaf(rng);
    }
    match rng.below(11) {
        0..=2 => {
            let mut props = serde_json::Map::new();
            for i in 0..rng.below(4) {
                props.insert(format!("p{i}"), random_schema(rng, depth - 1));
            }
            let required: Vec<String> = props
                .keys()
                .filter(|_| rng.below(2) == 0)
                .cloned()
                .collect();
            let listed = props.len();
            let mut o = json!({"type": "object", "properties": props, "required": required});
            if rng.below(2) == 0 {
                o["additionalProperties"] = json!(false);
            }
            // Bounds on the count (some contradict the required ones, and are refused).
            if rng.below(3) == 0 {
                o["minProperties"] = json!(rng.below(listed + 1));
            }
            if rng.below(3) == 0 {
                o["maxProperties"] = json!(rng.below(listed + 1));
            }
            o
        }
        3 => {
            let mut a = json!({"type": "array", "items": random_schema(rng, depth - 1)});
            if rng.below(2) == 0 {
                a["minItems"] = json!(rng.below(2));
                a["maxItems"] = json!(1 + rng.below(3));
            }
            a
        }
        4 => json!({
            "type": "array",
            "prefixItems": [random_schema(rng, depth - 1), random_schema(rng, depth - 1)],
            "items": if rng.below(2) == 0 { json!(false) } else { random_schema(rng, depth - 1) }
        }),
        5 => json!({"type": "array", "items": {"enum": ["r", "g", "b", 7]}, "uniqueItems": true}),
        6 => {
            // Objects alike under anyOf (sharing a first key), and scalars beside them.
            let n = 2 + rng.below(3);
            let mut alternatives: Vec<Value> = (0..n)
                .map(|i| {
                    let mut props = serde_json::Map::new();
                    props.insert("id".into(), random_schema(rng, 0));
                    props.insert(format!("only{i}"), random_schema(rng, depth - 1));
                    let mut required = vec![format!("only{i}")];
                    if rng.below(2) == 0 {
                        required.push("id".into());
                    }
                    json!({"type": "object", "properties": props, "required": required})
                })
                .collect();
            if rng.below(2) == 0 {
                alternatives.push(leaf(rng));
            }
            json!({"anyOf": alternatives})
        }
        7 => {
            // A discriminated union (pydantic's oneOf + discriminator).
            let alternatives: Vec<Value> = ["circle", "square", "line"][..1 + rng.below(3)]
                .iter()
                .map(|kind| {
                    json!({
                        "type": "object",
                        "properties": {"kind": {"const": kind}, "size": random_schema(rng, depth - 1)},
                        "required": ["kind"]
                    })
                })
                .collect();
            json!({"oneOf": alternatives, "discriminator": {"propertyName": "kind"}})
        }
        8 => json!({"type": "object", "additionalProperties": random_schema(rng, depth - 1)}),
        9 => json!({
            "type": "object",
            "additionalProperties": random_schema(rng, depth - 1),
            "propertyNames": *rng.pick(&[
                json!({"enum": ["k1", "k2", "k3"]}),
                json!({"maxLength": 2}),
                json!({"format": "date"}),
                json!({"pattern": "^[A-Z]"}),
            ]),
            "minProperties": rng.below(2),
            "maxProperties": 1 + rng.below(3)
        }),
        _ => json!({
            "type": "object",
            "patternProperties": {*rng.pick(&["^[a-z]{1,4}$", "^id_[0-9]+$", "x"]): random_schema(rng, depth - 1)},
            "minProperties": rng.below(2)
        }),
    }
}

fn hand_written() -> Vec<Value> {
    vec![
        json!({
            "$defs": {
                "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "name": {"type": "string"}, "lives": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["kind", "name", "lives"], "additionalProperties": false},
                "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "name": {"type": "string"}, "good": {"type": "boolean"}}, "required": ["kind", "name", "good"], "additionalProperties": false}
            },
            "type": "object",
            "properties": {
                "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}},
                "others": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}, "maxItems": 3},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            },
            "required": ["pet", "nick"],
            "additionalProperties": false
        }),
        json!({
            "$defs": {"t": {"anyOf": [
                {"type": "object", "properties": {"leaf": {"type": "integer"}}, "required": ["leaf"]},
                {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 3}}, "required": ["kids"]}
            ]}},
            "type": "object", "properties": {"root": {"$ref": "#/$defs/t"}}, "required": ["root"]
        }),
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                "seen": {"type": "string", "format": "date-time"},
                "mail": {"type": "string", "format": "email"},
                "site": {"type": "string", "format": "uri", "maxLength": 2083},
                "host": {"type": "string", "format": "hostname"},
                "v6": {"type": "string", "format": "ipv6"},
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "when": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "time"}, {"type": "string", "format": "duration"}]},
                "n": {"type": ["integer", "number"]}
            },
            "required": ["name", "age"]
        }),
        json!({
            "type": "object",
            "properties": {
                "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": false},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": true, "minItems": 1},
                "id": {"type": "string", "format": "uuid"},
                "price": {"type": "number", "multipleOf": 0.01, "minimum": 0}
            },
            "required": ["point", "tags"]
        }),
    ]
}

#[test]
fn constrained_outputs_validate_against_their_schemas() {
    let available = Command::new("python3")
        .args([
            "-c",
            "import jsonschema, rfc3339_validator, isoduration, fqdn",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !available {
        eprintln!(
            "WARNING: Python's `jsonschema` (with its format extras) is not importable here: constrained outputs \
             were NOT validated (scripts/test.sh installs it and sets PYTHONPATH)"
        );
        assert!(
            std::env::var_os("SPECULA_REQUIRE_JSONSCHEMA").is_none(),
            "SPECULA_REQUIRE_JSONSCHEMA is set but `import jsonschema` fails"
        );
        return;
    }
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let alphabet = alphabet();
    let mut schemas = hand_written();
    schemas.extend((0..120).map(|_| {
        let mut props = serde_json::Map::new();
        for i in 0..1 + rng.below(3) {
            props.insert(format!("f{i}"), random_schema(&mut rng, 3));
        }
        let required: Vec<String> = props.keys().cloned().collect();
        json!({"type": "object", "properties": props, "required": required})
    }));
    let dir = tempfile::tempdir().unwrap();
    let cases = dir.path().join("cases.jsonl");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&cases).unwrap());
    let (mut compiled, mut texts) = (0, 0);
    for schema in &schemas {
        let g = match JsonGrammar::from_schema(schema) {
            Ok(g) => g,
            // Random ones may be refused (a oneOf whose alternatives could both match, a range with no value);
            // the hand-written ones must compile.
            Err(e) => {
                assert!(!hand_written().contains(schema), "{schema} refused: {e}");
                continue;
            }
        };
        compiled += 1;
        let written: Vec<String> = (0..12)
            .filter_map(|_| walk(&g, &mut rng, 400, &alphabet))
            .collect();
        texts += written.len();
        writeln!(out, "{}", json!({"schema": schema, "texts": written})).unwrap();
    }
    drop(out);
    assert!(
        compiled >= 80,
        "only {compiled} of {} schemas compiled",
        schemas.len()
    );
    assert!(
        texts >= compiled * 6,
        "only {texts} finished texts from {compiled} schemas"
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/validate_json.py");
    eprintln!("{texts} texts from {compiled} of {} schemas", schemas.len());
    let run = Command::new("python3")
        .arg(script)
        .arg(&cases)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("validated {texts} texts")),
        "{stdout}"
    );
}
