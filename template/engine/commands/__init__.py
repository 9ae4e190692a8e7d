"""The commands: ``python -m <package> fit|validate|test|predict`` (LightningCLI), ``export``, ``tune``, and what the
command line adds to a Trainer. Uses every package below it; the user's code only through the configuration.
"""
