"""Print the README's set-up and test commands: the first ```bash block after the line
that says they run in CI. .ci/run executes what this prints, so a README whose commands
fail fails CI."""

import sys

MARKER = "<!-- ci: the commands below run verbatim in CI (.ci/run) -->"

lines = open(sys.argv[1] if len(sys.argv) > 1 else "README.md", encoding="utf-8").read().splitlines()
start = lines.index(MARKER)
begin = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
end = next(i for i in range(begin + 1, len(lines)) if lines[i].strip() == "```")
print("\n".join(lines[begin + 1 : end]))
