"""Entry points: the command line (``swiftspec ...``), the OpenAI-compatible server and its protocol."""
