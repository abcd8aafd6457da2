"""The official `openai` client against a running `specula serve` (crates/specula-cli/tests/openai_client.rs).

    python3 openai_client.py BASE_URL MODEL API_KEY
"""
import json
import re
import sys
import urllib.request

import openai

base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key)

listed = [m.id for m in client.models.list().data]
assert listed == [model], listed

done = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0)
assert done.choices[0].text, done
assert done.usage.completion_tokens >= 1 and done.usage.prompt_tokens >= 1, done.usage

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=12, temperature=0
)
answer = chat.choices[0].message.content
assert chat.choices[0].message.role == "assistant" and answer, chat

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "hi there"}],
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, usage = [], None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
assert "".join(pieces) == answer, (pieces, answer)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage

cut = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0, stop=[done.choices[0].text[2:4]])
assert cut.choices[0].finish_reason == "stop" and done.choices[0].text.startswith(cut.choices[0].text), cut

# The newer content form (a list of text parts) answers as the plain string does.
parts = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}], max_tokens=12,
    temperature=0,
)
assert parts.choices[0].message.content == answer, (parts, answer)
several = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=12, temperature=0, n=2
)
assert [c.index for c in several.choices] == [0, 1], several
assert all(c.message.content == answer for c in several.choices), (several, answer)
# Log-probabilities parse into the client's own types: chat's content entries, completions' legacy object with the
# echoed prompt (its first token has none).
scored = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=12, temperature=0, logprobs=True,
    top_logprobs=3,
)
entries = scored.choices[0].logprobs.content
assert len(entries) == scored.usage.completion_tokens, entries
assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in entries), entries
assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == answer, (entries, answer)
echoed = client.completions.create(model=model, prompt="hello world", max_tokens=4, temperature=0, logprobs=2,
                                   echo=True)
lp = echoed.choices[0].logprobs
assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:]), lp
assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) == echoed.usage.prompt_tokens + \
    echoed.usage.completion_tokens, lp
# Several prompts in one request: a choice per prompt, in order, each what the prompt alone answers.
batch = client.completions.create(model=model, prompt=["hello world", "hi there"], max_tokens=12, temperature=0)
assert [c.index for c in batch.choices] == [0, 1], batch
assert batch.choices[0].text == done.choices[0].text, (batch, done)

# Penalties and a bias are honoured: banning the greedy answer's first token changes the answer.
def tokenize(text):
    req = urllib.request.Request(base + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


prompt_ids = tokenize("hello world")
first_id = tokenize("hello world" + done.choices[0].text)[len(prompt_ids)]
penalized = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0,
                                      presence_penalty=1.0, frequency_penalty=0.5, logit_bias={str(first_id): -100})
assert penalized.choices[0].text and penalized.choices[0].text != done.choices[0].text, (penalized, done)
# JSON mode: the answer is one JSON object (whole, when the model stopped by itself).
structured = client.chat.completions.create(
    model=model, max_tokens=96, temperature=0, response_format={"type": "json_object"},
    messages=[{"role": "user", "content": "Describe a cat named Tom, aged 3, as JSON with keys name and age."}])
answer = structured.choices[0]
print("json mode:", repr(answer.message.content), answer.finish_reason)
assert answer.message.content.lstrip().startswith("{"), answer
if answer.finish_reason == "stop":
    assert isinstance(json.loads(answer.message.content), dict), answer
# Structured outputs: the answer is an object of the schema's shape, keys in its order.
cat = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}
structured = client.chat.completions.create(
    model=model, max_tokens=64, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": cat, "strict": True}},
    messages=[{"role": "user", "content": "Describe a cat named Tom, aged 3, as JSON."}])
answer = structured.choices[0]
print("json schema:", repr(answer.message.content), answer.finish_reason)
assert answer.message.content.lstrip().startswith('{'), answer
if answer.finish_reason == "stop":
    v = json.loads(answer.message.content)
    assert list(v) == ["name", "age"] and isinstance(v["name"], str) and isinstance(v["age"], int), v
# pydantic models through the client's own `parse` (its strict schema: a discriminated union of two objects,
# oneOf + discriminator, beside an optional string): accepted, and the answer validates as the model.
from typing import Literal, Optional, Union

import pydantic


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    name: str
    lives: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    name: str
    good: bool


class Pet(pydantic.BaseModel):
    pet: Union[Cat, Dog] = pydantic.Field(discriminator="kind")
    nick: Optional[str]


# Random weights favour whitespace, which JSON allows almost anywhere: a bias against it (and towards closing
# quotes) walks the answer through the union's keys.
structure_bias = {str(t): -100 for ws in [" ", "\n", "\r", "\t"] for t in tokenize(ws)}
structure_bias.update({str(t): 8 for t in tokenize('"')})
parsed = client.chat.completions.parse(
    model=model, max_tokens=160, temperature=0, response_format=Pet, logit_bias=structure_bias,
    messages=[{"role": "user", "content": "Describe a pet as JSON."}])
pet = parsed.choices[0].message.parsed
print("pydantic union:", pet)
assert isinstance(pet, Pet) and isinstance(pet.pet, (Cat, Dog)), parsed
# vLLM's guided decoding fields, as its users send them through extra_body: the answer is one of the choices, or
# matches the regex whole.
sentiment = client.chat.completions.create(
    model=model, max_tokens=8, temperature=0,
    messages=[{"role": "user", "content": "Is 'I love this library' positive or negative?"}],
    extra_body={"guided_choice": ["positive", "negative"]})
print("guided_choice:", sentiment.choices[0].message.content)
assert sentiment.choices[0].message.content in ("positive", "negative"), sentiment
phone = client.chat.completions.create(
    model=model, max_tokens=24, temperature=0,
    messages=[{"role": "user", "content": "Give me a US phone number."}],
    extra_body={"guided_regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"})
print("guided_regex:", phone.choices[0].message.content)
assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", phone.choices[0].message.content), phone
# Tools this model's chat template cannot render are refused by name, never dropped.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    raise SystemExit("tools were accepted by a template that cannot render them")
except openai.BadRequestError as e:
    assert "tools" in str(e), e
# A schema keyword the server cannot enforce is refused by name, never ignored.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "x", "schema": {"type": "object", "properties": {
                                           "s": {"type": "string", "format": "color"}}}}})
    raise SystemExit("a JSON schema keyword was accepted and would have been ignored")
except openai.BadRequestError as e:
    assert "format" in str(e), e
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   presence_penalty=3.0)
    raise SystemExit("presence_penalty out of range was accepted")
except openai.BadRequestError as e:
    assert "presence_penalty" in str(e), e

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError:
    pass
try:
    client.completions.create(model=model, prompt="x", max_tokens=10**9)
    raise SystemExit("max_tokens beyond the context was accepted")
except openai.BadRequestError as e:
    assert "max_tokens" in str(e), e
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("openai client checks passed")
