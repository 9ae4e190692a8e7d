"""Cookiecutter-only code: turns this live project into a renamed copy at bake time. Never copied into a bake."""
