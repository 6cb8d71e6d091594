"""One module per `tandem bench` tool; each exposes `add_arguments(parser)` and
`async run(client, args) -> ToolResult`."""
