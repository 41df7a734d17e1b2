"""Communication: process groups, collectives with timeouts, wire codecs."""
