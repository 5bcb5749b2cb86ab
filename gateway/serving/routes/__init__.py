"""The serving process's own routes: the OpenAI API, the admin API, the loop's admin API and training rounds."""
