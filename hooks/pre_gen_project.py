"""Before cookiecutter writes any file: refuse bad answers and never overwrite what is already in the folder."""

import json
import sys
from pathlib import Path

# Cookiecutter fills in a JSON object inside a raw string: answers arrive as data, never as code. A JSON object
# starts with { and cannot hold three unescaped quotes in a row, so no answer can end the string early.
BAKE = json.loads(r"""{{ {"answers": cookiecutter, "root": template_root()} | tojson }}""")
ANSWERS, TEMPLATE_ROOT = BAKE["answers"], Path(BAKE["root"])
# {% raw %}
# Cookiecutter leaves its rendered copy of this script, answers included, in the temporary folder.
Path(__file__).unlink(missing_ok=True)
sys.path.insert(0, str(TEMPLATE_ROOT))

from cookiecutter_bake.answers import AnswerError, check_answers  # noqa: E402
from cookiecutter_bake.bake import refuse_overwrites  # noqa: E402

try:
    # Checked again here: --replay and cruft can bring answers that were never prompted for.
    check_answers(ANSWERS, TEMPLATE_ROOT)
    refuse_overwrites(TEMPLATE_ROOT, ANSWERS, Path.cwd())
except AnswerError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
# {% endraw %}
