"""Chat samples for supervised fine-tuning: validation, chat templates, token ids and loss masks.

A chat sample is a list of messages `{"role": str, "content": str}` (other keys are passed to
the template) with at least one `assistant` turn. `ChatEncoder.encode` renders it with a Jinja
chat template and returns its token ids with a mask that is 1 on the tokens of assistant turns
(their content and the template's end-of-turn marker) and 0 on everything else (system and user
turns, role headers, BOS), so only the answers are in the loss.

Which template: `DataConfig.chat_template` names a file, or `builtin` (ChatML turns
`<|im_start|>role\\n...<|im_end|>\\n`); empty takes the tokenizer's own, `chat_template` of a
`tokenizer_config.json` or a `chat_template.jinja` next to its `tokenizer.json`, else the
built-in one. Templates run in Jinja's sandbox with the variables transformers passes
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`) and its `raise_exception`.

How assistant turns are found: for the assistant message i, the rendering of messages[:i] with
the generation prompt must be a prefix of the rendering of messages[:i+1], itself a prefix of
the whole sample; the text between the two is the assistant turn. This holds for the usual
templates (ChatML, Llama 3, SmolLM2); a template whose earlier turns change with later ones is
rejected with a clear error. Each piece is tokenized apart, so a prompt is tokenized as it will
be at generation time (`prompt_ids`). As in transformers' `apply_chat_template`, special tokens
written by the template (and in message text) are read as control tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.train.data.config import CHAT_SPECIAL_TOKENS

if TYPE_CHECKING:
    from tidal.train.data.tokenizer import Tokenizer

Messages = list[dict[str, Any]]

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML turns, the template used when a tokenizer has none."""

_PROBE: Messages = [
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "#### 2"},
]


def check_messages(sample: Any, where: str) -> Messages:
    """`sample` if it is a valid chat sample, else a ValueError naming `where` (file:line).

    Valid: a non-empty list of dicts, each with string `role` and `content`, at least one of
    them an `assistant` turn.
    """
    if not isinstance(sample, list) or not sample:
        raise ValueError(
            f"{where}: a chat sample must be a non-empty list of messages "
            f'[{{"role": ..., "content": ...}}], got {type(sample).__name__}'
        )
    for i, m in enumerate(sample):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {i} is {type(m).__name__}, expected an object")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = type(m[key]).__name__ if key in m else "missing"
                raise ValueError(f"{where}: message {i} needs a string {key!r} ({got})")
    if not any(m["role"] == "assistant" for m in sample):
        roles = [m["role"] for m in sample]
        raise ValueError(
            f"{where}: the sample has no assistant turn (roles {roles}); SFT learns from "
            "assistant turns only, so every sample needs one"
        )
    return sample


def find_template(setting: str, tokenizer_path: str | None) -> tuple[str, str]:
    """(name, Jinja source) of the chat template `DataConfig.chat_template` selects.

    Raises:
        FileNotFoundError: a template file named by `setting` does not exist.
        ValueError: a `tokenizer_config.json` whose `chat_template` is unreadable.
    """
    if setting == "builtin":
        return "builtin", BUILTIN_TEMPLATE
    if setting:
        p = Path(setting).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"chat template file not found: {p} (DataConfig.chat_template)")
        return str(p), p.read_text(encoding="utf-8")
    if tokenizer_path is not None:
        folder = Path(tokenizer_path).expanduser().parent
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"{config}: cannot read chat_template: {e}") from None
            if isinstance(template, list):  # named templates: take "default", else the first
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default", template[0].get("template") if template else None)
            if isinstance(template, str) and template:
                return str(config), template
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return str(jinja), jinja.read_text(encoding="utf-8")
    return "builtin", BUILTIN_TEMPLATE


class ChatTemplate:
    """A compiled chat template.

    Raises (constructor):
        ValueError: the template does not compile (syntax error, with its line).
    """

    def __init__(
        self, source: str, *, name: str = "chat template", bos_token: str = "", eos_token: str = ""
    ) -> None:
        import jinja2
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.name, self.source = name, source
        self._errors: tuple[type[Exception], ...] = (jinja2.TemplateError, TypeError, KeyError)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"chat template {name} does not compile: line {e.lineno}: {e.message}"
            ) from None
        self._vars = {"bos_token": bos_token, "eos_token": eos_token}
        # Templates with tool support (HF's) read a `tools` variable: render passes it then.
        self.declares_tools = "tools" in meta.find_undeclared_variables(env.parse(source))

    def check(self) -> None:
        """Render a small conversation (with and without the generation prompt); raises
        ValueError if the template cannot."""
        where = "a probe conversation (user, assistant)"
        self.render(_PROBE, where=where)
        self.render(_PROBE[:1], add_generation_prompt=True, where=where)

    def render(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = False,
        where: str = "a sample",
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text for `messages`; ValueError (naming `where`) if it fails.

        `tools` (OpenAI-style function specs) is passed as the template's `tools` variable
        when given; tidal/rl/envs/tool_calls.py decides when a template can take it.
        """
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self._vars,
                **extra,
            )
        except self._errors as e:
            raise ValueError(
                f"chat template {self.name} cannot render {where}: {type(e).__name__}: {e}"
            ) from None


class ChatEncoder:
    """Chat samples to token ids and loss masks with one tokenizer and one template.

    Attributes:
        stop_ids: token ids that end an assistant turn (EOS, and the template's end-of-turn
            token when it is a special token, e.g. `<|im_end|>`), for generation.
        stop_text: the end-of-turn text (`<|im_end|>`); generation output is cut there.

    Example::

        enc = ChatEncoder(tokenizer, ChatTemplate(BUILTIN_TEMPLATE, name="builtin"))
        ids, mask = enc.encode([{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"}])
        prompt = enc.prompt_ids([{"role": "user", "content": "Hi"}])  # ends "assistant\\n"
    """

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer, self.template = tokenizer, template
        # Render a small conversation now: a template that cannot render fails here, before
        # any data is read, and its end-of-turn marker becomes the stop token.
        text, spans = self.spans(_PROBE, "a probe conversation (user, assistant)")
        start, end = spans[0]
        answer = _PROBE[1]["content"]
        at = text.find(answer, start, end)
        suffix = text[at + len(answer) : end] if at >= 0 else ""
        self.stop_text = suffix.strip()
        self.stop_ids = {tokenizer.eos_id}
        first = tokenizer.encode(suffix, special_tokens=True)[:1] if suffix.strip() else []
        if first and tokenizer.is_special(first[0]):
            self.stop_ids.add(first[0])

    def spans(self, messages: Messages, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered sample and the character spans of its assistant turns."""
        render = self.template.render
        text = render(messages, where=where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:i], add_generation_prompt=True, where=where)
            upto = text if i == len(messages) - 1 else render(messages[: i + 1], where=where)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(
                    f"chat template {self.template.name} cannot mark the assistant turn {i} of "
                    f"{where}: rendering the conversation up to it is not a prefix of "
                    "rendering it whole (the template rewrites earlier turns); use "
                    "--data.chat_template builtin or a template without that behaviour"
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def encode(self, messages: Messages, where: str = "a sample") -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of one sample."""
        (ids,), (mask,) = self.encode_many([messages], [where])
        return ids, mask

    def encode_many(
        self, samples: Sequence[Messages], wheres: Sequence[str] | Callable[[int], str]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, loss masks) of many samples, tokenized in one batch.

        `wheres[i]` (or `wheres(i)`) names sample i in errors (file:line).
        """
        name = wheres if callable(wheres) else wheres.__getitem__
        pieces: list[str] = []
        counts: list[int] = []
        for i, messages in enumerate(samples):
            text, spans = self.spans(messages, name(i))
            cuts = [0, *(c for span in spans for c in span), len(text)]
            pieces.extend(text[a:b] for a, b in zip(cuts, cuts[1:], strict=False))
            counts.append(len(cuts) - 1)
        encoded = self.tokenizer.encode_batch(pieces, special_tokens=True)
        bos = self.tokenizer.bos_id
        all_ids, all_masks, k = [], [], 0
        for n in counts:
            ids, mask = [], []
            for j in range(n):  # pieces alternate: prompt, assistant, prompt, ...
                ids.extend(encoded[k + j])
                mask.extend([j % 2] * len(encoded[k + j]))
            k += n
            if not ids or ids[0] != bos:  # the template did not write BOS: add it
                ids.insert(0, bos)
                mask.insert(0, 0)
            all_ids.append(ids)
            all_masks.append(mask)
        return all_ids, all_masks

    def prompt_ids(self, messages: Messages) -> list[int]:
        """Token ids of `messages` followed by the generation prompt (the assistant header),
        tokenized as `encode` tokenizes the same prefix; a trailing assistant turn is dropped."""
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        text = self.template.render(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, special_tokens=True)
        return ids if ids and ids[0] == self.tokenizer.bos_id else [self.tokenizer.bos_id, *ids]

    def fingerprint(self) -> str:
        """Keys caches of encoded samples: the tokenizer, the template and this format."""
        h = hashlib.sha256(b"tidal-chat-v1|")
        h.update(self.tokenizer.fingerprint().encode())
        h.update(self.template.source.encode())
        return h.hexdigest()


def build_encoder(tokenizer: Tokenizer, setting: str, tokenizer_path: str | None) -> ChatEncoder:
    """The ChatEncoder for `DataConfig.chat_template` = `setting` and this tokenizer."""
    name, source = find_template(setting, tokenizer_path)
    template = ChatTemplate(
        source,
        name=name,
        bos_token=tokenizer.token_text(tokenizer.bos_id),
        eos_token=tokenizer.token_text(tokenizer.eos_id),
    )
    return ChatEncoder(tokenizer, template)


def training_text(text: str) -> str:
    """Rendered chat text for BPE training, the built-in turn markers taken out (they are
    special tokens, never merged)."""
    for marker in CHAT_SPECIAL_TOKENS:
        text = text.replace(marker, "\n")
    return text
