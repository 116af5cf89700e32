"""Plain text of an HTML fragment (``--strip-html``: Stack Overflow bodies are HTML): tags
removed, entities unescaped, block tags as line breaks, ``<pre>`` and ``<code>`` kept verbatim.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_BLOCK_TAGS = frozenset(
    "p div br pre blockquote ul ol li dl dt dd table tr thead tbody h1 h2 h3 h4 h5 h6 hr "
    "section article header footer figure figcaption".split()
)
_DROP_TAGS = frozenset({"script", "style"})


class _TextExtractor(HTMLParser):
    """Collects the text of an HTML fragment; ``convert_charrefs`` unescapes entities."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._dropping = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _DROP_TAGS:
            self._dropping += 1
        elif tag == "li":
            self.parts.append("\n- ")
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")
        self._pre += tag == "pre"

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)  # <br/> is one line break, not an open and a close

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROP_TAGS:
            self._dropping = max(0, self._dropping - 1)
        elif tag in _BLOCK_TAGS and tag != "li":  # the next item's "- " starts its own line
            self.parts.append("\n")
        if tag == "pre":
            self._pre = max(0, self._pre - 1)

    def handle_data(self, data: str) -> None:
        # Text inside <code> and <pre> is kept verbatim: for Stack Overflow it is much of the content.
        if self._dropping:
            return
        if not self._pre and data.isspace() and "\n" in data:
            # Source line breaks between tags: nothing at a line start (after a block tag),
            # a word space between inline elements, as a browser would render them.
            if self.parts and not self.parts[-1].endswith("\n"):
                self.parts.append(" ")
            return
        self.parts.append(data)


def html_to_text(html: str) -> str:
    """Plain text of an HTML fragment: tags removed, entities unescaped, block tags as line breaks."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts).replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)  # trailing spaces left by inline breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip()
