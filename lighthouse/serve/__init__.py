"""How ``lighthouse serve`` starts a lighthouse: the command's flags and the server's settings."""
