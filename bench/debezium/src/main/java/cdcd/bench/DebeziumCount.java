package cdcd.bench;

import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.ChangeEvent;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.ObjectOutputStream;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.connect.data.Struct;
import org.apache.kafka.connect.source.SourceRecord;

/**
 * Debezium's embedded engine with a consumer that only counts change events, for the benchmark.
 *
 * <p>Usage: {@code DebeziumCount <engine.properties> <expected events> <timeout seconds>}. The
 * properties are the engine's and the connector's own, plus {@code bench.offset}: when set, a JSON
 * source offset (for MySQL/MariaDB {@code {"file":...,"pos":...}}) written into the file offset
 * store before the engine starts, so the connector streams from that binlog position.
 *
 * <p>Prints one JSON line on stdout when {@code expected} data change events were consumed:
 * {@code {"events": n, "seconds_from_start": s, "seconds_from_first_event": f, "first_key": k}}
 * (start = JVM start; k = the first event's key, e.g. {@code Struct{id=1}}), then halts. Exits 2 if
 * the engine stops first, 3 on timeout, with the reason on stderr.
 */
public final class DebeziumCount {

    private DebeziumCount() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: DebeziumCount <engine.properties> <expected events> <timeout seconds>");
            System.exit(64);
        }
        Properties props = new Properties();
        try (InputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        long expected = Long.parseLong(args[1]);
        long timeoutSeconds = Long.parseLong(args[2]);
        String offset = (String) props.remove("bench.offset");
        if (offset != null) {
            presetOffset(props, offset);
        }
        Counter counter = new Counter(expected);
        DebeziumEngine<ChangeEvent<SourceRecord, SourceRecord>> engine = DebeziumEngine.create(Connect.class)
                .using(props)
                .notifying(counter)
                .using((success, message, error) -> {
                    // the engine stopped before the count was reached: say why and fail
                    System.err.println("debezium engine stopped after " + counter.count + " of " + expected
                            + " events (success=" + success + "): " + message);
                    if (error != null) {
                        error.printStackTrace();
                    }
                    System.err.flush();
                    Runtime.getRuntime().halt(2);
                })
                .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        executor.shutdown();
        if (!executor.awaitTermination(timeoutSeconds, TimeUnit.SECONDS)) {
            System.err.println("debezium consumed " + counter.count + " of " + expected + " events in "
                    + timeoutSeconds + " s; raise the timeout or check the connector log above");
            System.err.flush();
            Runtime.getRuntime().halt(3);
        }
    }

    /** Write one source offset into the FileOffsetBackingStore file, in the layout it loads. */
    private static void presetOffset(Properties props, String offsetJson) throws IOException {
        String file = props.getProperty("offset.storage.file.filename");
        String name = props.getProperty("name");
        String server = props.getProperty("topic.prefix");
        if (file == null || name == null || server == null) {
            throw new IllegalArgumentException(
                    "bench.offset needs offset.storage.file.filename, name and topic.prefix in the properties");
        }
        // the key as the engine's JsonConverter (schemas disabled) serialises [namespace, partition]
        String key = "[\"" + name + "\",{\"server\":\"" + server + "\"}]";
        Map<byte[], byte[]> raw = new HashMap<>();
        raw.put(key.getBytes(StandardCharsets.UTF_8), offsetJson.getBytes(StandardCharsets.UTF_8));
        try (ObjectOutputStream out = new ObjectOutputStream(new FileOutputStream(file))) {
            out.writeObject(raw);
        }
    }

    /** Counts data change events (records with an envelope "op"); prints the figures at the target. */
    private static final class Counter
            implements DebeziumEngine.ChangeConsumer<ChangeEvent<SourceRecord, SourceRecord>> {
        private final long expected;
        private volatile long count;
        private long firstNanos;
        private String firstKey = "";

        Counter(long expected) {
            this.expected = expected;
        }

        @Override
        public void handleBatch(List<ChangeEvent<SourceRecord, SourceRecord>> records,
                DebeziumEngine.RecordCommitter<ChangeEvent<SourceRecord, SourceRecord>> committer)
                throws InterruptedException {
            for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                Object value = event.value().value();
                if (value instanceof Struct struct && struct.schema().field("op") != null) {
                    if (count == 0) {
                        firstNanos = System.nanoTime();
                        firstKey = String.valueOf(event.value().key());
                    }
                    count++;
                }
                committer.markProcessed(event);
            }
            committer.markBatchFinished();
            if (count >= expected) {
                report();
            }
        }

        private void report() {
            long now = System.nanoTime();
            double fromStart = (System.currentTimeMillis()
                    - ManagementFactory.getRuntimeMXBean().getStartTime()) / 1000.0;
            double fromFirst = (now - firstNanos) / 1e9;
            String key = firstKey.replace("\\", "\\\\").replace("\"", "\\\"");
            System.out.println(String.format(Locale.ROOT,
                    "{\"events\": %d, \"seconds_from_start\": %.3f, \"seconds_from_first_event\": %.3f, "
                            + "\"first_key\": \"%s\"}",
                    count, fromStart, fromFirst, key));
            System.out.flush();
            // the figures are out: stop at once rather than wait for the connector's orderly shutdown
            Runtime.getRuntime().halt(0);
        }
    }
}
