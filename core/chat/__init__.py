"""What chat formats add on top of text: tool calls written in each model family's own format
(tool_calls.py; the formats, one file per family, in tool_formats/), reasoning sections
(reasoning.py) and gpt-oss's harmony channels (harmony.py)."""
