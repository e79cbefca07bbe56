"""Speculative decoding: drafters (MTP head, n-gram lookup), the verify pass, acceptance and the state commit."""
