"""Validates texts against JSON schemas with the `jsonschema` package (an independent validator, formats checked),
for crates/specula/tests/json_outputs_validate.rs.

    python3 validate_json.py CASES.jsonl

Each line: {"schema": ..., "texts": [...]}. Prints one line per failure and a summary; exits 1 on any failure.
"""
import decimal
import json
import sys

import jsonschema

failures = 0
texts = 0
schemas = 0
# The latest draft's format checker (the default FormatChecker's "time" is draft 3's, without an offset).
checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
# Formats the grammar enforces must be checked here too, not skipped for want of a library.
missing = {"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"} - set(
    checker.checkers)
if missing:
    sys.exit(f"jsonschema's format checker lacks {sorted(missing)}: install jsonschema[format-nongpl]")
with open(sys.argv[1]) as f:
    for line in f:
        # Numbers as decimals, in the schema and the texts: JSON numbers are decimal, and with floats the
        # validator finds -9.52 no multiple of 0.01 (-9.52 / 0.01 = -951.9999999999999).
        case = json.loads(line, parse_float=decimal.Decimal)
        schema = case["schema"]
        cls = jsonschema.validators.validator_for(schema)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        schemas += 1
        for text in case["texts"]:
            texts += 1
            try:
                value = json.loads(text, parse_float=decimal.Decimal)
            except ValueError as e:
                failures += 1
                print(f"NOT JSON: {text!r}: {e}")
                continue
            errors = list(validator.iter_errors(value))
            if errors:
                failures += 1
                print(f"INVALID: schema {json.dumps(schema, default=str)}\n  text {text!r}\n  {errors[0].message}")
print(f"validated {texts} texts against {schemas} schemas: {failures} failures")
sys.exit(1 if failures else 0)
