"""Reading a written dataset: its source, the reader, the read plan, batch assembly."""
