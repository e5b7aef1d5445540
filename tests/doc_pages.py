"""The shell commands of a docs page, for the tests that follow a page as written."""

import re
import shlex
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def shell_commands(page: str, section: str | None = None, *, before: str | None = None):
    r"""Each command of the page's ```sh blocks (a line, or lines joined by a trailing `\`),
    split like a shell would, in order; from the heading `section` on, and before the
    heading `before`, when given."""
    text = (DOCS / page).read_text()
    if section is not None:
        text = text[text.index(f"\n{section}\n") :]
    if before is not None:
        text = text[: text.index(f"\n{before}\n")]
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line.strip()]
