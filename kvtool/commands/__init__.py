"""One module per subcommand: parse flags, call the engine, render a table or print JSON."""
