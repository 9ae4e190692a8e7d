"""The machinery that runs any LightningModule: command line, strategies, callbacks, file IO. Not yours to edit."""
