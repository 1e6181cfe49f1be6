class ChatSession:
    """A conversation as token ids.

    The model's own reply tokens are kept exactly as generated (EOS included), never re-tokenized from
    text; a new message adds only what the chat template renders for it, found by rendering the
    conversation with and without it. The template's default system prompt is thus rendered once.
    """

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.token_ids: list[int] = []
        self._rendered = ""  # the template's text up to the last generation prompt
        self._reply_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def user_turn(self, text: str) -> list[int]:
        """Add a user message; return the token ids to send (the whole prompt on the first turn)."""
        before = self._render(add_generation_prompt=False) if self.token_ids else ""
        self.messages.append({"role": "user", "content": text})
        rendered = self._render(add_generation_prompt=True)
        if not rendered.startswith(before):
            raise ValueError("this chat template rewrites earlier turns; it cannot be continued incrementally")
        glue = self._unfinished_reply_tail(before) if self._reply_ids is not None else ""
        new_ids = self._encode(glue + rendered[len(before) :])
        self._rendered = rendered
        self._reply_ids = None
        self.token_ids += new_ids
        return new_ids

    def add_reply(self, token_ids: list[int], text: str | None = None) -> None:
        """Record the model's reply: its tokens as generated, its text for the template."""
        if text is None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.token_ids += token_ids
        self.messages.append({"role": "assistant", "content": text})
        self._reply_ids = list(token_ids)

    def _unfinished_reply_tail(self, rendered_with_reply: str) -> str:
        """What the template closes a reply with beyond what the model generated (e.g. the newline
        after <|im_end|>, or the whole end-of-turn marker of a reply that was stopped)."""
        reply = rendered_with_reply[len(self._rendered) :]
        generated = self.tokenizer.decode(self._reply_ids, skip_special_tokens=False)
        return reply[len(generated) :] if reply.startswith(generated) else ""

    def _render(self, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
