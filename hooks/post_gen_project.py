"""After cookiecutter rendered README, LICENSE, CI and pre-commit: copy the live project in, renamed."""

import json
import sys
from pathlib import Path

# Cookiecutter fills in a JSON object inside a raw string: answers arrive as data, never as code. A JSON object
# starts with { and cannot hold three unescaped quotes in a row, so no answer can end the string early.
BAKE = json.loads(r"""{{ {"answers": cookiecutter, "root": template_root(), "cruft": under_cruft()} | tojson }}""")
ANSWERS, TEMPLATE_ROOT = BAKE["answers"], Path(BAKE["root"])
# {% raw %}
# Cookiecutter leaves its rendered copy of this script, answers included, in the temporary folder.
Path(__file__).unlink(missing_ok=True)
sys.path.insert(0, str(TEMPLATE_ROOT))

from cookiecutter_bake.answers import AnswerError  # noqa: E402
from cookiecutter_bake.bake import copy_live_files, finish  # noqa: E402

try:
    copy_live_files(TEMPLATE_ROOT, Path.cwd(), ANSWERS)
    finish(TEMPLATE_ROOT, Path.cwd(), ANSWERS, commit=not BAKE["cruft"])
except (AnswerError, FileExistsError) as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
# {% endraw %}
