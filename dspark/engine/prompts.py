"""Prompts into token ids: text, token ids, or chat messages rendered by the model's template."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.config import field_error

# apply_chat_template's own parameters: template variables may not override them
_RESERVED = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                       "return_dict", "return_tensors", "tools", "documents", "chat_template", "padding",
                       "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class PromptError(ValueError):
    """A prompt the engine cannot render; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ChatPrompt:
    """Chat messages and how the template renders them (vLLM's chat request options):
    add_generation_prompt opens the assistant's turn; continue_final_message instead leaves the
    last (assistant) message open, so the model continues it; template_kwargs are extra template
    variables (a model's `enable_thinking`, say); tools are the function definitions the
    template may show the model (OpenAI's `tools` entries)."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None

    def validate(self) -> None:
        if not self.messages:
            raise PromptError("a chat prompt needs at least one message", "messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise PromptError("add_generation_prompt and continue_final_message cannot both be true",
                              "continue_final_message")
        if self.continue_final_message and self.messages[-1].get("role") != "assistant":
            raise PromptError("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        clash = sorted(_RESERVED & set(self.template_kwargs))
        if clash:
            raise PromptError(f"chat_template_kwargs may not set {clash[0]!r}", "chat_template_kwargs")


def encode_prompt(tokenizer, vocab_size: int, prompt: str | list[int] | list[dict] | ChatPrompt) -> list[int]:
    """Token ids of a prompt: a string (with the tokenizer's special tokens, a Llama's BOS, as
    vLLM does), token ids (checked against the vocabulary), or chat messages."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        prompt = ChatPrompt(prompt)
    if isinstance(prompt, ChatPrompt):
        out = _apply_template(tokenizer, prompt, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise field_error(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "prompt")
        return list(prompt)
    raise field_error("prompt must be a string, a list of token ids, or a list of chat messages", "prompt")


def render_chat(tokenizer, prompt: ChatPrompt) -> str:
    """The text the model's chat template makes of a chat prompt (before tokenization)."""
    return _apply_template(tokenizer, prompt, tokenize=False)


def _apply_template(tokenizer, prompt: ChatPrompt, tokenize: bool):  # noqa: ANN202 - ids or text
    prompt.validate()
    try:
        return tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message, tools=prompt.tools, tokenize=tokenize,
            **prompt.template_kwargs)
    except Exception as e:  # the template's own checks (e.g. roles that must alternate)
        raise PromptError(f"the chat template rejected the messages: {e}", "messages") from e


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as the token sequences that would write it (vLLM's rule): the word itself,
    and with a leading space when that is another token sequence of the same length."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
