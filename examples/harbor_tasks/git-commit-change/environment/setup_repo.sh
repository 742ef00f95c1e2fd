set -e
mkdir -p /app/repo && cd /app/repo
git init -q -b main
git config user.name Init && git config user.email init@example.com
printf 'Helo world\n' > README.md
git add README.md
git commit -qm 'Initial commit'
git config --unset user.name && git config --unset user.email
printf 'Hello world\n' > README.md
