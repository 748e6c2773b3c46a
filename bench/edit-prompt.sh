# Sourced by bench/lookup.sh and bench/split-speed.sh: the code-edit prompt they time.
# edit_prompt FILE prints a function (FILE) and the instruction to write it again with its
# parameter tax_rate renamed, ending where the model's copy begins.
edit_prompt() {
  printf 'Here is a Python function:\n\n```python\n%s\n```\n\nThe same function with the parameter tax_rate renamed to vat_rate everywhere, and nothing else changed:\n\n```python\n' "$(cat "$1")"
}
