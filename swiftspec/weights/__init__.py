"""Weight sources: the loader and its cache, the default pair, GGUF and AWQ conversion, random weights, host memory."""
