#!/bin/sh
# The compose stack's broker, secured (docker-compose.yml; docs/compose.md). Replaces the
# image's entrypoint; works on apache/kafka (Alpine, user appuser) and on any image with
# Kafka's jars in /opt/kafka/libs and java on PATH (deploy/smoke/kafka).
#
#   KAFKA_FOO_BAR=v -> foo.bar=v (the official image's convention: "_" -> ".", "__" -> "_",
#   "___" -> "-"); the non-secret settings stay in docker-compose.yml.
#   $ROLLWAY_SECRETS/broker.properties  SCRAM listener + authorizer + super users, written
#                                       by `rollway acl credentials` (the credentials service)
#   $ROLLWAY_SECRETS/scram-users        the admin and broker SCRAM users, created when the
#                                       storage is first formatted (KRaft: the brokers' own
#                                       user must exist before they talk; the other users
#                                       and the ACLs come from `rollway acl apply` in init)
# The properties hold the broker's password: written owner-only to a private folder.
set -eu
secrets="${ROLLWAY_SECRETS:-/run/rollway}"
for f in broker.properties scram-users; do
    [ -r "$secrets/$f" ] || { echo "secure-start: $secrets/$f missing or unreadable (the credentials service writes it)" >&2; exit 1; }
done
umask 077
dir=$(mktemp -d)
conf="$dir/server.properties"
echo "log.dirs=${KAFKA_LOG_DIRS:-/var/lib/kafka/data}" > "$conf"
# JVM and launcher variables are not broker properties.
env | grep '^KAFKA_' \
    | grep -v -e '^KAFKA_LOG_DIRS=' -e '^KAFKA_HEAP_OPTS=' -e '^KAFKA_OPTS=' -e '^KAFKA_JVM_' -e '^KAFKA_LOG4J' \
          -e '^KAFKA_JMX' -e '^KAFKA_HOME=' -e '^KAFKA_VERSION=' -e '^KAFKA_GC_' -e '^KAFKA_LIBS=' \
    | while IFS='=' read -r name value; do
        key=$(echo "${name#KAFKA_}" | tr 'A-Z' 'a-z' | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
        echo "$key=$value" >> "$conf"
    done
cat "$secrets/broker.properties" >> "$conf"
set --
while IFS= read -r user; do
    [ -n "$user" ] && set -- "$@" --add-scram "$user"
done < "$secrets/scram-users"
cp="${KAFKA_LIBS:-/opt/kafka/libs}/*"
java -cp "$cp" kafka.tools.StorageTool format --cluster-id="${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" \
    -c "$conf" --ignore-formatted "$@"
set --
log4j=""
[ -r /opt/kafka/config/log4j2.yaml ] && log4j="-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.yaml"
# shellcheck disable=SC2086  # the heap options are several words
exec java ${KAFKA_HEAP_OPTS:--Xmx512m -Xms512m} -XX:+UseG1GC -Djava.awt.headless=true $log4j -cp "$cp" \
    kafka.Kafka "$conf"
