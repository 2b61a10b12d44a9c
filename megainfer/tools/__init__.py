"""The top floor's tools, beside `megainfer/cli/`: they may import every package below them."""
